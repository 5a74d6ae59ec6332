"""The search's memo and pruning change no answer: a strategy predicted inside ``search_memo`` (after many
others filled it) equals its prediction outside, and the search that skips strategies whose model states alone
exceed the device ranks exactly what the unpruned search ranks."""

from modelpar.plan import HARDWARE, ModelSpec, SearchSpace, activations, chunks, load_model, memory, predict, states
from modelpar.plan.memo import Bounded, search_memo
from modelpar.plan.search import _search, _states_exceed, strategies, valid_layouts

H100 = HARDWARE["h100-80gb"]
LLAMA_8B = ModelSpec(load_model("llama-8b").shape, flash_attention=True)
SEQ = 4096
SPACE = SearchSpace(cp=1, schedules=("1f1b", "interleaved", "zbv"), max_vpp=2, max_micro_batch_size=2)


def _strategies(gpus: int, batch: int) -> list:
    layouts = valid_layouts(LLAMA_8B, gpus, batch, SPACE, SEQ)
    return [s for layout in layouts for s in strategies(LLAMA_8B, layout, batch, SEQ, SPACE)]


def test_predictions_inside_the_memo_equal_those_outside():
    every = _strategies(8, 8)
    assert len(every) > 500
    picked = every[::7] + [s.__class__(**{**s.__dict__, "offload": True}) for s in every[::23]]
    outside = [predict(s, LLAMA_8B, H100, seq_len=SEQ) for s in picked]
    with search_memo():
        for s in every[1::3]:  # fill the memo with the neighbours first
            predict(s, LLAMA_8B, H100, seq_len=SEQ)
        inside = [predict(s, LLAMA_8B, H100, seq_len=SEQ) for s in reversed(picked)][::-1]
    assert inside == outside


def test_pruning_by_model_states_ranks_the_same_strategies():
    layouts = valid_layouts(LLAMA_8B, 8, 8, SPACE, SEQ)
    assert any(_states_exceed(LLAMA_8B, s, SEQ, H100) for s in _strategies(8, 8))
    with search_memo():
        pruned, _ = _search(LLAMA_8B, H100, layouts, 8, SEQ, None, SPACE, None)
    with search_memo():
        whole, _ = _search(LLAMA_8B, H100, layouts, 8, SEQ, None, SPACE, None, prune=False)
    assert pruned and pruned == whole


def test_a_moe_stage_bytes_do_not_depend_on_the_ep_priced_before():
    from modelpar.parallel.layout import ParallelLayout
    from modelpar.plan import Strategy
    from modelpar.plan.activations import _PIECE_BYTES

    qwen3 = load_model("qwen3-30b-a3b")

    def strategy(ep):
        layout = ParallelLayout(pp=4, dp=4, vpp=2, ep=ep)
        return Strategy(layout, 1, 16, "selective", recompute_modules=("elementwise",), pipeline="zbv")

    _PIECE_BYTES.clear()
    alone = predict(strategy(2), qwen3, H100, seq_len=SEQ).memory
    _PIECE_BYTES.clear()
    predict(strategy(1), qwen3, H100, seq_len=SEQ)
    assert predict(strategy(2), qwen3, H100, seq_len=SEQ).memory == alone


def test_the_caches_that_outlive_a_search_stay_bounded_and_forgetting_changes_no_answer(monkeypatch):
    caches = [activations._PIECE_BYTES, chunks._PARTITIONS, chunks._PIECES, memory._CANDIDATES]
    assert all(isinstance(cache, Bounded) for cache in caches)
    picked = _strategies(8, 8)[::17]
    before = [predict(s, LLAMA_8B, H100, seq_len=SEQ) for s in picked]
    for cache in caches:
        monkeypatch.setattr(cache, "limit", 2)
        cache.clear()
    monkeypatch.setattr(states, "_PER_MODEL", 2)
    states._STATES.clear()
    after = [predict(s, LLAMA_8B, H100, seq_len=SEQ) for s in picked]
    assert after == before
    assert all(len(cache) <= 2 for cache in [*caches, *(held for _, held in states._STATES.values())])
    states._STATES.clear()  # leave no cache with the small limit behind


def test_a_bounded_cache_forgets_its_oldest_entry():
    cache = Bounded(2)
    cache["a"], cache["b"], cache["a"], cache["c"] = 1, 2, 3, 4
    assert cache == {"b": 2, "c": 4}
