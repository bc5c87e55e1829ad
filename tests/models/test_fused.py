"""Decoder blocks through the fused CPU ops: which models, how close, and still row-exact."""

from __future__ import annotations

import pytest
import torch

from evospec.kernels.cpu_ops import load_cpu_ops
from evospec.models.fused import enable_fused_ops, supports_fused_ops
from evospec.models.loading import load_model
from evospec.models.quant import kernels_available, quantize_linears
from evospec.models.step import StepGraph
from tests.decoding.spec_helpers import prompt_of, tiny_target

pytestmark = pytest.mark.skipif(
    not (load_cpu_ops() and kernels_available("int4")), reason="needs the fused CPU ops and int4 kernels"
)


def _fused(seed: int, fmt: str = "int4", head_dim: int = 8):
    model = tiny_target(seed, head_dim=head_dim)
    quantize_linears(model, fmt)
    model.exact_rows = True
    assert enable_fused_ops(model)
    return model


def test_which_models_take_the_fused_ops():
    assert not supports_fused_ops(tiny_target(0))  # fp32 linears: their own kernels, f32 activations
    for fmt in ("int4", "int8", "bf16"):
        m = tiny_target(0)
        quantize_linears(m, fmt)
        assert supports_fused_ops(m), fmt
    gemma = tiny_target(0, family="gemma3")
    quantize_linears(gemma, "int4")
    assert supports_fused_ops(gemma)  # its own layer ops (tests/models/test_fused_gemma.py)
    assert not supports_fused_ops(tiny_target(0, family="gemma3"))  # fp32 linears


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_fused_logits_stay_close_to_the_aten_path(fmt):
    aten, fused = tiny_target(2), _fused(2, fmt)
    quantize_linears(aten, fmt)
    assert_prefill_logits_close(aten, fused)


def assert_prefill_logits_close(aten, fused) -> None:
    """A 20-token prefill's logits on the fused ops stay within 2% of the aten path's range,
    with the same argmax at >= 90% of the positions (bf16 activations round differently)."""
    tokens = torch.tensor([prompt_of(3, 20)])

    def logits(m):
        return m(tokens, torch.arange(20), m.new_cache(24)).logits[0]

    ref, out = logits(aten), logits(fused)
    assert (out - ref).abs().max() <= 0.02 * (ref.max() - ref.min())
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def _steps(model, prompt, n):
    cache = model.new_cache(64)
    out = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache, logits="last")
    seen = []
    for _ in range(n):
        tok = out.logits[0, -1].argmax().view(1, 1)
        out = model(tok, torch.tensor([cache.length]), cache, logits="last")
        seen.append((int(tok), out.logits[0, -1].clone()))
    return seen


def test_recorded_fused_steps_are_bitwise_the_eager_ones_and_call_the_ops():
    model = _fused(3)
    prompt = prompt_of(2, 6)
    eager = _steps(model, prompt, 20)
    graph = model.step_graph = StepGraph(model)
    recorded = _steps(model, prompt, 20)
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(eager, recorded, strict=True))
    code = str(graph._graphs[1, "last"].inlined_graph)
    # int4 on our VNNI kernel: all layers are one llama_stack op (the calls below, in C++)
    vnni = model.layers[0].self_attn.qkv.kernel == "vnni"
    loop_ops = ("rope_qkv", "add_rms_norm_bf16", "silu_mul_bf16", "decode_attention")
    for op in ("llama_stack",) if vnni else loop_ops:
        assert f"evospec::{op}" in code
    assert code.count("evospec::llama_stack") == (1 if vnni else 0)
    assert "evospec::llama_layer" not in code


def assert_verification_reproduces_steps(model, prompt: list[int], tree: str) -> None:
    """A 4-token chain or a branching tree after ``prompt``, verified in one forward, gives each
    row bitwise the logits of the one-token step at its position."""
    steps = _steps(model, prompt, 4)
    path = [t for t, _ in steps]
    p = len(prompt)
    cache = model.new_cache(64)
    model(torch.tensor([prompt]), torch.arange(p), cache, logits="none")
    if tree == "chain":
        tokens, mask, rows, depths = path[:4], None, [0, 1, 2, 3], [0, 1, 2, 3]
    else:  # path[0] -> {path[1] (row 1), a sibling (row 2)}, path[1] -> path[2] (row 3)
        tokens = [path[0], path[1], (path[1] + 1) % 64, path[2]]
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        rows, depths = [0, 1, None, 2], [0, 1, 1, 2]
    out = model(torch.tensor([tokens]), p + torch.tensor(depths), cache, mask, logits="all").logits[0]
    for row, step in enumerate(rows):
        if step is not None:
            assert torch.equal(out[row], steps[step][1]), row


def assert_padded_rows_decode_as_alone(model, short: list[int], long: list[int], tol: float) -> None:
    """A left-padded two-row batch prefill: each row's last logits as its prompt's alone."""
    n = len(long)
    cache = model.new_cache(n + 12, batch=2)
    tokens = torch.tensor([[0] * (n - len(short)) + short, long])
    out = model(tokens, torch.arange(n), cache, left_pad=torch.tensor([n - len(short), 0]), logits="last")
    for row, prompt in enumerate((short, long)):
        fresh = model.new_cache(n + 12)
        alone = model(torch.tensor([prompt]), torch.arange(len(prompt)), fresh, logits="last")
        torch.testing.assert_close(out.logits[row, -1], alone.logits[0, -1], rtol=tol, atol=tol)


@pytest.mark.parametrize("tree", ["chain", "branching"])
def test_fused_verification_reproduces_one_token_steps(tree):
    """A chain (recorded graph) or a branching tree (eager rows) verified in one forward gives
    each row the logits plain decoding computes at that position, bit for bit."""
    model = _fused(5)
    model.step_graph = StepGraph(model)
    assert_verification_reproduces_steps(model, prompt_of(4, 7), tree)


@pytest.mark.parametrize("head_dim", [8, 64])
@pytest.mark.parametrize("prompt_len", [7, 14, 16])
def test_recorded_tree_verification_is_bitwise_the_eager_rows_and_the_steps(head_dim, prompt_len):
    """A branching tree verified through a recorded graph (``TreeRows``: one llama_stack op whose
    attention gives each row its ancestors) computes every row's logits, hidden state and K/V bit
    for bit as the eager row-exact forward, and the path plain decoding takes as its steps --
    also where the tree's keys straddle a block of 16 (prompts of 14 and 16 tokens)."""
    model = _fused(5, head_dim=head_dim)
    graph = StepGraph(model)
    if not graph.trees:
        pytest.skip("tree graphs need our int4 kernel on every layer")
    prompt = prompt_of(4, prompt_len)
    steps = _steps(model, prompt, 4)
    path = [t for t, _ in steps]
    # root -> {path[1] (1), sibling (2), sibling (3)}; 1 -> path[2] (4); 2 -> x (5); 4 -> path[3] (6)
    parents = [-1, 0, 0, 0, 1, 2, 4]
    tokens = [path[0], path[1], (path[1] + 1) % 64, (path[1] + 2) % 64, path[2], 9, path[3]]
    depths = [0, 1, 1, 1, 2, 2, 3]
    mask = torch.eye(7, dtype=torch.bool)
    for i, par in enumerate(parents):
        while par >= 0:
            mask[i, par], par = True, parents[par]

    def verify(step_graph):
        model.step_graph = step_graph
        cache = model.new_cache(64)
        p = len(prompt)
        model(torch.tensor([prompt]), torch.arange(p), cache, logits="none")
        out = model(torch.tensor([tokens]), p + torch.tensor(depths), cache, mask, logits="all")
        return out.logits[0], out.hidden[0], cache.k[..., : cache.length, :].clone()

    eager = verify(None)
    recorded = verify(graph)
    assert (7, "all", "tree") in graph._graphs
    for a, b in zip(eager, recorded, strict=True):
        assert torch.equal(a, b)
    for row, step in ((0, 0), (1, 1), (4, 2), (6, 3)):
        assert torch.equal(recorded[0][row], steps[step][1]), row


def test_a_reset_graph_takes_trees_only_while_the_model_runs_one_stack_op():
    model = _fused(5, head_dim=64)
    graph = StepGraph(model)
    if not graph.trees:
        pytest.skip("tree graphs need our int4 kernel on every layer")
    model.fused_ops = False  # as after swapping the model's modules for the aten path
    graph.reset()
    assert not graph.trees
    with pytest.raises(ValueError, match="one llama_stack op"):
        graph.record(3, "all", tree=True)


def test_tree_rows_must_see_themselves_and_no_later_row():
    model = _fused(5, head_dim=64)
    graph = StepGraph(model)
    if not graph.trees:
        pytest.skip("tree graphs need our int4 kernel on every layer")
    cache = model.new_cache(16)
    model(torch.tensor([prompt_of(4, 5)]), torch.arange(5), cache, logits="none")
    bad = torch.tensor([1, 2 | 4, 4])  # row 1 sees row 2, which comes after it
    with pytest.raises(RuntimeError, match="no later row"):
        graph(torch.tensor([[1, 2, 3]]), torch.tensor([5, 6, 6]), cache, "all", tree=bad)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_fused_prefill_writes_what_one_token_steps_write(fmt):
    """A prompt prefilled in one forward gives bitwise the K/V and the features that feeding it
    one token at a time gives: what lets a later prompt reuse the slots (decoding/prefix.py)."""
    model = _fused(6, fmt, head_dim=64)
    prompt = prompt_of(5, 23)
    batched, stepped = model.new_cache(32), model.new_cache(32)
    out = model(torch.tensor([prompt]), torch.arange(23), batched, logits="all")
    for i, tok in enumerate(prompt):
        row = model(torch.tensor([[tok]]), torch.tensor([i]), stepped, logits="last")
        assert torch.equal(out.logits[0, i], row.logits[0, -1]), i
        assert torch.equal(out.hidden[0, i], row.hidden[0, -1]), i
    assert torch.equal(batched.k[:, :, :, :23], stepped.k[:, :, :, :23])
    assert torch.equal(batched.v[:, :, :, :23], stepped.v[:, :, :, :23])
    # and a prompt split in two forwards (the second after the first's slots) gives the same
    split = model.new_cache(32)
    model(torch.tensor([prompt[:9]]), torch.arange(9), split, logits="none")
    tail = model(torch.tensor([prompt[9:]]), torch.arange(9, 23), split, logits="all")
    assert torch.equal(tail.logits[0], out.logits[0, 9:])
    assert torch.equal(split.k[:, :, :, :23], batched.k[:, :, :, :23])


def test_fused_models_keep_an_f16_cache_and_a_masked_batch_still_attends_over_it():
    """The fused ops' attention reads f16 K/V; the rare masked multi-row forward (a left-padded
    batch's prefill) converts them for SDPA, so a padded row decodes as it does alone."""
    model = _fused(4)
    assert model.new_cache(8).k.dtype == torch.float16
    assert tiny_target(4).new_cache(8).k.dtype == torch.float32
    assert_padded_rows_decode_as_alone(model, prompt_of(1, 5), prompt_of(2, 9), 1e-4)


def test_load_model_switches_a_quantised_model_onto_the_fused_ops(monkeypatch, tmp_path):
    from evospec.models import loading

    monkeypatch.setattr(
        loading, "_load", lambda *a, **k: loading.LoadedModel(tiny_target(7), None, tmp_path, "t")
    )
    assert load_model("t", progress=False, weights="int4").model.fused_ops
    assert not load_model("t", progress=False, weights="int4", fused_ops=False).model.fused_ops
    assert not load_model("t", progress=False, weights="fp32").model.fused_ops


def assert_one_op_layers_match_the_loop(model, monkeypatch) -> None:
    """A prefill, one-token steps and a chain through the one-op layers give bitwise the logits
    and K/V of the op-by-op loop (eager here; recorded graphs are held to the eager forward)."""
    import evospec.models.fused as fused

    if model.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the one-op layers need our int4 kernel (AVX-512 VNNI)")

    def run() -> tuple[list[torch.Tensor], torch.Tensor]:
        cache = model.new_cache(32)
        logits = [model(torch.tensor([prompt_of(3, 9)]), torch.arange(9), cache, logits="all").logits]
        for pos in (9, 10):  # one-token steps
            logits.append(model(torch.tensor([[pos % 64]]), torch.tensor([pos]), cache, logits="all").logits)
        chain = model(torch.tensor([[5, 7, 11]]), torch.arange(11, 14), cache, logits="all")
        logits.append(chain.logits)
        return logits, cache.k[:, :, :, :14].clone()

    assert fused._layer_op_applies(model, model.new_cache(4), None, None)  # the first run takes the op
    with torch.inference_mode():
        ops = run()
        monkeypatch.setattr(fused, "_layer_op_applies", lambda *a: False)
        loop = run()
    assert all(torch.equal(a, b) for a, b in zip(ops[0], loop[0], strict=True))
    assert torch.equal(ops[1], loop[1])


@pytest.mark.parametrize("head_dim", [8, 64])
def test_one_op_layers_give_the_op_by_op_loops_bits(monkeypatch, head_dim):
    """llama_layer makes the layer loop's calls in C++: one team of threads per layer where the
    head size is a multiple of 16 (llama_layer.cpp), the ops one by one otherwise."""
    assert_one_op_layers_match_the_loop(_fused(6, head_dim=head_dim), monkeypatch)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_layer_team_gives_the_op_by_op_layers_bits(monkeypatch, threads):
    """The layers' team of threads (llama_stack; llama_layer where intermediate outputs are asked
    for) and the op-by-op calls (EVOSPEC_LAYER_TEAM=0) write the same K/V, features and logits:
    prefill, steps, chains, on 1-3 threads."""
    model = _fused(8, head_dim=64)
    if model.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the one-op layers need our int4 kernel (AVX-512 VNNI)")

    def run() -> tuple[list[torch.Tensor], torch.Tensor]:
        cache = model.new_cache(96)  # a 70-row prefill: more rows than the team keeps buffers for
        logits = [model(torch.tensor([prompt_of(7, 70)]), torch.arange(70), cache, logits="all").logits]
        for pos in (70, 71):
            logits.append(model(torch.tensor([[pos % 64]]), torch.tensor([pos]), cache, logits="all").logits)
        logits.append(model(torch.tensor([[5, 7, 11, 13]]), torch.arange(72, 76), cache, logits="all").logits)
        # with intermediate outputs asked for (EAGLE-3), the layers run as one op each
        aux = model(torch.tensor([[17, 19]]), torch.arange(76, 78), cache, logits="all", aux_layers=(0, 1))
        logits += [aux.logits, *aux.aux_hidden]
        return logits, torch.cat([cache.k[:, :, :, :78], cache.v[:, :, :, :78]])

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            team = run()
            monkeypatch.setenv("EVOSPEC_LAYER_TEAM", "0")
            ops = run()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(team[0], ops[0], strict=True))
    assert torch.equal(team[1], ops[1])


@pytest.mark.parametrize("widened", [False, True])
def test_the_fused_draft_step_computes_the_eager_draft_layer(widened):
    """draft_step (fc, then the head's layer, as one op) gives the eager int4 layer's features up
    to its activation rounding, writes the same K/V slots, and a chain of pairs behind the cache
    sees what one pair at a time sees (row j: the cache and rows 0..j); also for a head whose
    MLP was grown (``widen_mlp``) past the target's."""
    from evospec.models.eagle import new_eagle_for, quantised_head, widen_mlp
    from evospec.models.fused import enable_fused_draft

    target = _fused(4, head_dim=64)
    if target.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the fused draft step needs our int4 kernel (AVX-512 VNNI)")
    head = new_eagle_for(target, seed=3)
    if widened:
        head = widen_mlp(head, 3 * head.cfg.intermediate_size, seed=1)
        torch.nn.init.normal_(head.layers[0].mlp.down_proj.weight, std=0.05)  # the new units speak
    head = quantised_head(head, "int4")
    assert enable_fused_draft(head)
    g = torch.Generator().manual_seed(0)
    head.fc.matmul.bias = torch.randn(target.cfg.hidden_size, generator=g)  # random_init zeroes it
    feats = torch.randn(1, 9, target.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 9), generator=g)

    def run(fused: bool, split: bool) -> tuple[torch.Tensor, torch.Tensor]:
        head.fused_step = fused
        cache = head.new_cache(16)
        with torch.inference_mode():
            if split:  # 5 pairs, then 4 one at a time: the same rows as one call of 9
                outs = [head(feats[:, :5], tokens[:, :5], torch.arange(5), cache, None)]
                for i in range(5, 9):
                    outs.append(
                        head(feats[:, i : i + 1], tokens[:, i : i + 1], torch.tensor([i]), cache, None)
                    )
                out = torch.cat(outs, dim=1)
            else:
                out = head(feats, tokens, torch.arange(9), cache, None)
        return out, cache.k[:, :, :, :9].clone()

    fused, fused_k = run(True, False)
    eager, eager_k = run(False, False)
    split, split_k = run(True, True)
    assert torch.equal(fused, split) and torch.equal(fused_k, split_k)  # row-exact chains
    scale = eager.abs().max()
    assert (fused - eager).abs().max() <= 0.03 * scale  # bf16 activation codes vs the eager path's
    assert (fused_k - eager_k).abs().max() <= 0.03 * eager_k.abs().max()
    head.fused_step = True


def test_draft_step_ids_takes_its_pairs_and_rope_rows_in_the_op():
    """``draft_step_ids`` (the embedding's rows and the RoPE tables read in the op) gives the
    fused draft step's bits -- outputs and K/V -- for a catch-up of pairs and one-row steps, at
    positions read from the tables; an id outside the vocabulary or a position past the tables
    is a clear error, and the cache is left as it was."""
    from evospec.models.eagle import new_eagle_for, quantised_head
    from evospec.models.fused import draft_ids_apply, enable_fused_draft, run_fused_draft_ids

    target = _fused(4, head_dim=64)
    if target.layers[0].self_attn.qkv.kernel != "vnni":
        pytest.skip("the fused draft step needs our int4 kernel (AVX-512 VNNI)")
    head = quantised_head(new_eagle_for(target, seed=3), "int4").attach(target)
    assert enable_fused_draft(head) and draft_ids_apply(head)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(9, target.cfg.hidden_size, generator=g)
    tokens = torch.randint(0, target.cfg.vocab_size, (9,), generator=g)
    rope = head.rope(torch.arange(32), torch.float32)
    want_cache, got_cache = head.new_cache(16), head.new_cache(16)
    with torch.inference_mode():
        want = [head(feats[None, :5], tokens[None, :5], torch.arange(5), want_cache, None)[0]]
        got = [run_fused_draft_ids(head, feats[:5], tokens[:5], 0, rope, got_cache)]
        for i in range(5, 9):
            want.append(
                head(feats[None, i : i + 1], tokens[None, i : i + 1], torch.tensor([i]), want_cache, None)[0]
            )
            got.append(run_fused_draft_ids(head, feats[i : i + 1], tokens[i : i + 1], i, rope, got_cache))
        assert got_cache.length == want_cache.length == 9
        assert torch.equal(torch.cat(got), torch.cat(want))
        assert torch.equal(got_cache.k[..., :9, :], want_cache.k[..., :9, :])
        assert torch.equal(got_cache.v[..., :9, :], want_cache.v[..., :9, :])
        one = feats[:1]
        with pytest.raises(RuntimeError, match="outside the vocabulary"):
            run_fused_draft_ids(head, one, torch.tensor([target.cfg.vocab_size]), 9, rope, got_cache)
        with pytest.raises(RuntimeError, match="RoPE tables have no rows"):
            run_fused_draft_ids(head, one, tokens[:1], 32, rope, got_cache)
        assert got_cache.length == 9
