"""Command-line tools and benchmark scripts refuse bad arguments in one line, before any work starts."""

import argparse
import pathlib
import sys

import pytest

from modelpar.cli.args import check_layouts, positive_float, positive_int
from tests import warm_cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "two", ""])
def test_positive_int_refuses_anything_but_a_whole_number_above_zero(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a positive integer"):
        positive_int(text)
    assert positive_int("3") == 3


@pytest.mark.parametrize("text", ["0", "-2.5", "nan", "inf", "x"])
def test_positive_float_refuses_zero_negative_and_non_finite(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a positive number"):
        positive_float(text)
    assert positive_float("0.5") == 0.5


def test_check_layouts_names_the_bad_entry():
    parser = argparse.ArgumentParser(prog="x")
    check_layouts(parser, ["tp2-pp2-1f1b", "single", "pp2-vpp2-interleaved"])
    with pytest.raises(SystemExit):
        check_layouts(parser, ["tp2", "tp2-foo"])


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("pipeline_bubble.py", ["--pp", "2", "3", "--m", "4"], "--m 4 is not a multiple of every --pp 2 3"),
        ("plan_vs_measured.py", ["--rounds", "0"], "argument --rounds: '0' is not a positive integer"),
        ("plan_vs_measured.py", ["--layouts", "tpx"], "layout 'tpx': cannot read 'tpx'"),
        ("transport_threads.py", ["--layouts", "tp2-foo"], "layout 'tp2-foo': cannot read 'foo'"),
        ("kernels.py", ["--smoke", "--only", "rope,foo"], "--only foo: not a kernel; choose from rms_norm"),
        ("gpu_llama1b_mfu.py", ["--smoke", "--steps", "0"], "argument --steps: '0' is not a positive integer"),
    ],
)
def test_benchmark_scripts_refuse_bad_arguments_in_one_line(tmp_path, script, args, message):
    done = warm_cli.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last, done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "0"], "argument --tokens: '0' is not a positive integer"),
        (["--temperature", "-1"], "argument --temperature: '-1' is not a number >= 0"),
    ],
)
def test_generate_refuses_bad_numbers_before_loading_anything(args, message, capsys):
    from modelpar.cli.generate import main

    with pytest.raises(SystemExit) as exit_info:
        main(["/nonexistent/checkpoint", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_eval_refuses_zero_windows_in_one_line():
    from modelpar.cli.eval import eval_config
    from modelpar.training.config import RecipeError, TrainConfig

    cfg = TrainConfig()
    cfg.eval.windows = 0
    with pytest.raises(RecipeError, match=r"^eval.windows=0 must be >= 1$"):
        eval_config(cfg)
