"""modelpar-train: placeholder until the training entry point lands."""


def main() -> None:
    print("modelpar-train: training is coming soon; the layout and emulated-rank foundation is installed.")


if __name__ == "__main__":
    main()
