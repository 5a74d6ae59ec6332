"""Property: any recipe and layout is either trained or rejected with one clear line, never a traceback."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from modelpar.testing import run_on_ranks
from modelpar.training.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig, TrainerConfig
from modelpar.training.preflight import USER_ERRORS, check_recipe

VOCAB = 64
RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@st.composite
def recipes(draw) -> TrainConfig:
    """Mostly plausible recipes (so that many run), each field sometimes wrong (so that many are rejected)."""
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    head_dim = draw(st.sampled_from([2, 4, 4, 5, 8]))
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    model = ModelConfig(
        vocab_size=draw(st.integers(1, VOCAB)),
        hidden=heads * head_dim + draw(st.sampled_from([0, 0, 0, 0, 1])),
        layers=draw(st.integers(1, 6)),
        heads=heads,
        kv_heads=draw(st.sampled_from([*divisors, *divisors, 3])),
        ffn_hidden=draw(st.sampled_from([8, 12, 16, 24, 7])),
        max_seq_len=draw(st.sampled_from([16, 32])),
        tie_embeddings=True,
    )
    tp, pp, dp = (draw(st.sampled_from([1, 1, 2, 2, 3, 4])) for _ in range(3))
    m = draw(st.integers(1, 4))
    parallel = ParallelConfig(
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=draw(st.sampled_from([1, 1, 1, 2])),
        sp=draw(st.booleans()),
        schedule=draw(st.sampled_from(["gpipe", "1f1b", "1f1b", "interleaved", "zb-h1", "chimera"])),
        microbatches=m,
    )
    data = DataConfig(
        seq_len=draw(st.sampled_from([4, 8, 16, 64])),
        global_batch=draw(st.one_of(st.just(dp * m), st.just(2 * dp * m), st.integers(1, 16))),
    )
    return TrainConfig(model=model, parallel=parallel, data=data, optim=OptimConfig(zero=draw(st.sampled_from([0, 1]))))


def one_step(cfg: TrainConfig, data_path: str) -> float:
    from modelpar.training.trainer import Trainer

    return Trainer(cfg, data_path, None).train_step().loss


@pytest.fixture(scope="module")
def token_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 1, size=4000, dtype=np.uint16))  # id 0 fits any vocab
    return str(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=recipes())
def test_every_recipe_is_run_or_rejected_in_one_line(cfg, token_path, tmp_path):
    try:
        check_recipe(cfg)
    except USER_ERRORS as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)
        event(f"rejected: {type(exc).__name__}")
        return
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    if world > 4:
        event("accepted, not run (world > 4)")
        return  # accepted; too many ranks to run on this machine's test budget
    cfg = TrainConfig(
        model=cfg.model,
        parallel=cfg.parallel,
        data=cfg.data,
        optim=cfg.optim,
        trainer=TrainerConfig(steps=1, out_dir=str(tmp_path), progress=False, timeout_s=60),
    )
    losses = run_on_ranks(world, one_step, cfg, token_path, timeout_s=120)
    assert all(np.isfinite(losses))
    event("accepted and trained one step")


@pytest.mark.parametrize(
    "group, field, value, needle",
    [
        ("optim", "lr", -1.0, "optim.lr=-1.0 must be >= 0"),
        ("optim", "lr", float("inf"), "optim.lr=inf must be >= 0, and finite"),
        ("optim", "min_lr", 1.0, "optim.min_lr=1.0 must be between 0 and optim.lr=0.003"),
        ("optim", "beta2", 1.0, "optim.beta2=1.0 must be in [0, 1)"),
        ("optim", "eps", float("nan"), "optim.eps=nan must be > 0"),
        ("optim", "weight_decay", -0.1, "optim.weight_decay=-0.1 must be >= 0"),
        ("optim", "bucket_mb", 0.0, "optim.bucket_mb=0.0 must be > 0"),
        ("model", "norm_eps", 0.0, "model.norm_eps=0.0 must be > 0"),
        ("model", "rope_theta", -5.0, "model.rope_theta=-5.0 must be > 0"),
        ("data", "seed", -1, "data.seed=-1 must be in [0, 2**32)"),
        ("trainer", "seed", 2**32, "trainer.seed=4294967296 must be in [0, 2**32)"),
        ("trainer", "log_every", 0, "trainer.log_every=0 must be >= 1"),
        ("trainer", "ckpt_every", -5, "trainer.ckpt_every=-5 must be >= 0 (0: no checkpoints)"),
        ("trainer", "keep_last", -1, "trainer.keep_last=-1 must be >= 0 (0: keep every checkpoint)"),
        ("trainer", "straggler_factor", 0.5, "trainer.straggler_factor=0.5 must be > 1"),
        ("trainer", "spike_factor", 0.9, "trainer.spike_factor=0.9 must be 0 (off) or > 1"),
        ("trainer", "check_every", -1, "trainer.check_every=-1 must be >= 0 (0: never)"),
        ("trainer", "threads_per_rank", 0, "trainer.threads_per_rank=0 must be >= 1"),
    ],
)
def test_numbers_outside_their_range_are_named_with_the_range(group, field, value, needle):
    import dataclasses

    from modelpar.training.config import RecipeError, validate

    cfg = TrainConfig()
    setattr(cfg, group, dataclasses.replace(getattr(cfg, group), **{field: value}))
    with pytest.raises(RecipeError) as caught:
        validate(cfg)
    assert str(caught.value) == needle or str(caught.value).startswith(needle)
    assert "\n" not in str(caught.value)
    validate(TrainConfig())  # the defaults pass


@pytest.mark.parametrize("name", sorted(p.stem for p in RECIPES.glob("*.yaml")))
def test_every_shipped_recipe_composes_and_validates(name):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from modelpar.bench.config import register_bench_schema
    from modelpar.training.config import register_schema, validate

    register_schema()
    register_bench_schema()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name=name, overrides=["trainer.out_dir=unused"]))
    layout = validate(cfg)
    assert layout.world_size >= 1
