"""Hunyuan V4 and dots3-note checkpoints in DeepSeek-V4's stored scheme (``models/v4_stored.py``): a tiny model of each
built by transformers' classes, its attention, indexer, dense-MLP and shared-expert projections written as block-FP8
(e4m3, one ``weight_scale_inv`` per block: float32 for Hunyuan V4, UE8M0 for dots3-note) and its routed experts one
matrix per expert as MXFP4 (two E2M1 values a byte, a UE8M0 scale per 32), the router, norms, gates and head left in
float. The runtime keeps the stored bytes, their products are the dequantised weights', and its greedy tokens over a
batch of prompts are transformers' on the dequantised checkpoint; the worker counts the weights as stored; a layout or
format the models cannot take is refused naming the tensor. On two ranks (``tensor_parallel_size=2``, blocks the
heads' and MLPs' slices end on) the tokens are one rank's, each rank holding its experts and its cut of the FP8
blocks, counted as the planner counts a rank's shard; a slice that ends inside a block is refused naming it."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_runtime import LLM, SamplingParams
from mla_runtime.layers.fp4 import Mxfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.hyper import PackedExperts, StoredLinear
from mla_runtime.models.dots3_note import load_dots3_note
from mla_runtime.models.hy_v4 import load_hy_v4
from mla_runtime.parallel import ParallelContext
from mla_runtime.row_plan import plan_rows
from tests.conformance import _recorded_selections
from tests.test_v4_stored import mxfp4, mxfp4_dequantized

tf = pytest.importorskip("transformers")

BLOCK = (8, 16)  # several blocks each way in the tiny matrices; the sliding layers' widths end inside blocks
PROMPT_LENS, NEW_TOKENS = (23, 9, 17), 6
FLOAT_KEPT = ("norm", ".mlp.gate.", "weights_proj", ".g_proj.")  # norms, routers, per-head gates: float
LOADERS: dict[str, Callable[..., torch.nn.Module]] = {"hy_v4": load_hy_v4, "dots3_note": load_dots3_note}


def _randomised(hf: torch.nn.Module) -> torch.nn.Module:
    """Every weight away from its init (gates, sinks and biases too), as the family tests do."""
    with torch.no_grad():
        bias = [(n, b) for n, b in hf.named_buffers() if n.endswith("e_score_correction_bias")]
        for name, p in [*hf.named_parameters(), *bias]:
            if name.endswith(("base", "scale", "bias", "sinks")):
                p.copy_(0.3 * torch.randn(p.shape) + name.endswith("scale"))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            else:
                p.copy_(torch.randn(p.shape) * p.shape[-1] ** -0.5)
    return hf.eval()


def build(family: str) -> torch.nn.Module:
    """The tiny transformers model of ``family``, its experts' widths multiples of 32 (MXFP4's group)."""
    from tests.test_families_dots3_note import TEXT as DOTS
    from tests.test_families_hy_v4 import TEXT as HY

    torch.manual_seed(0)
    if family == "hy_v4":
        config = tf.HYV4Config(**{**HY, "moe_intermediate_size": 32})
        config._attn_implementation = "eager"
        return _randomised(tf.HYV4ForCausalLM(config))
    config = tf.Dots3NoteTextConfig(**{**DOTS, "moe_intermediate_size": 32})
    config._attn_implementation = "eager"
    return _randomised(tf.Dots3NoteForCausalLM(config))


def fp8_blocks(w: torch.Tensor, ue8m0: bool, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> e4m3 values and one scale per ``block`` (``[ceil(N / bn), ceil(K / bk)]``, the last blocks
    partial; UE8M0: the next power of two of amax / 448)."""
    bn, bk = block
    n, k = w.shape
    padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = w
    amax = padded.abs().reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk).amax(dim=(1, 3))
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (w / _wide(scale, n, k, block)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale.float()


def _wide(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    return scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' packed ``mlp.experts.gate_up_proj [E, 2I, d]`` / ``down_proj [E, d, I]`` -> one matrix per
    expert, ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``."""
    out = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep or tail not in ("gate_up_proj", "down_proj"):
            out[name] = t
            continue
        for e, m in enumerate(t):
            parts = dict(zip(("gate_proj", "up_proj"), m.chunk(2))) if tail == "gate_up_proj" else {"down_proj": m}
            out.update({f"{head}.mlp.experts.{e}.{p}.weight": v.contiguous() for p, v in parts.items()})
    return out


def _in_layout_of(original: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (one matrix per expert) in ``original``'s names: packed where transformers packs them."""
    out = {}
    for name, t in original.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep or tail not in ("gate_up_proj", "down_proj"):
            out[name] = tensors[name]
            continue
        parts = ("gate_proj", "up_proj") if tail == "gate_up_proj" else ("down_proj",)
        out[name] = torch.stack([torch.cat([tensors[f"{head}.mlp.experts.{e}.{p}.weight"] for p in parts])
                                 for e in range(t.shape[0])]).to(t.dtype)
    return out


def kind_of(name: str) -> str | None:
    """``fp8``, ``experts`` or None (kept float) for a checkpoint tensor."""
    if ".layers." not in name or not name.endswith(".weight") or any(k in name for k in FLOAT_KEPT):
        return None
    return "experts" if ".mlp.experts." in name else "fp8"


def write_stored(float_dir: Path, stored_dir: Path, dequant_dir: Path, ue8m0: bool,
                 block: tuple[int, int] = BLOCK) -> dict[str, tuple[Any, Any]]:
    """``float_dir`` (transformers' save) -> ``stored_dir``: FP8 ``block`` blocks, MXFP4 experts one matrix per
    expert, scales as ``X.weight_scale_inv``; ``dequant_dir``: transformers' layout with every stored tensor replaced
    by its dequantisation. Returns the stored ``(values, scale)`` of each quantised tensor by stored name."""
    original = load_file(str(next(float_dir.glob("*.safetensors"))))
    stored, dequant, written = {}, {}, {}
    for name, w in _per_expert(original).items():
        kind = kind_of(name)
        if kind is None:
            stored[name] = dequant[name] = w
            continue
        q, s = mxfp4(w.float()) if kind == "experts" else fp8_blocks(w.float(), ue8m0, block)
        dense = mxfp4_dequantized(q, s) if kind == "experts" else q.float() * _wide(s, *w.shape, block)
        dequant[name], written[name] = dense.to(w.dtype), (q, s)
        stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = q, s
    for d, ts in ((stored_dir, stored), (dequant_dir, _in_layout_of(original, dequant))):
        d.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(d / "model.safetensors"))
    raw = json.loads((float_dir / "config.json").read_text())
    shutil.copy(float_dir / "config.json", dequant_dir / "config.json")
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": "ue8m0" if ue8m0 else "float",
                                  "expert_dtype": "fp4"}
    (stored_dir / "config.json").write_text(json.dumps(raw))
    return written


@pytest.fixture(scope="module", params=["hy_v4", "dots3_note"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    family = request.param
    root = tmp_path_factory.mktemp(family)
    out: dict[str, Any] = {k: root / k for k in ("float", "stored", "dequant")}
    build(family).save_pretrained(out["float"])
    out["written"] = write_stored(out["float"], out["stored"], out["dequant"], ue8m0=family == "dots3_note")
    out["family"] = family
    return out


def _dense(m: Any) -> torch.Tensor:
    """A stored matrix's float weight ``[N, K]``, by its product with the identity."""
    return m.matmul(torch.eye(m.shape[1]), None).T


def test_resident_weights_are_the_stored_bytes(checkpoint: dict[str, Any]) -> None:
    """Every quantised tensor is held as its stored bytes (FP8 one a weight, MXFP4 half, gate and up stacked), and
    its product is its dequantisation's."""
    model = LOADERS[checkpoint["family"]](checkpoint["stored"])
    written, experts = checkpoint["written"], 0
    for name, (q, s) in written.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if sep:
            continue
        layer = model.get_submodule(name.removesuffix(".weight").replace(".linear_gate", ".gate_proj"))
        assert isinstance(layer, StoredLinear) and isinstance(layer.blocks[0], Fp8Weight), name
        m = layer.blocks[0]
        assert m.weight.dtype == torch.float8_e4m3fn and torch.equal(m.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(_dense(m), q.float() * _wide(s, *q.shape)), name
    for module_name, module in model.named_modules():
        if not isinstance(module, PackedExperts):
            continue
        assert module.stored is not None and not hasattr(module, "gate_up_proj")
        for e, (gate_up, down) in enumerate(zip(*module.stored)):
            head = f"{module_name}.{e}"
            (gq, gs), (uq, us), (dq, ds) = (written[f"{head}.{p}.weight"] for p in ("gate_proj", "up_proj",
                                                                                     "down_proj"))
            assert [type(m) for m in gate_up] == [Mxfp4Weight] and isinstance(down, Mxfp4Weight)
            assert torch.equal(gate_up[0].packed, torch.cat([gq, uq]).view(torch.uint8))
            assert torch.equal(gate_up[0].scales, torch.cat([gs, us]).view(torch.uint8))
            assert torch.equal(down.packed, dq.view(torch.uint8)) and down.nbytes == dq.numel() + ds.numel()
            want = torch.cat([mxfp4_dequantized(gq, gs), mxfp4_dequantized(uq, us)])
            assert torch.equal(_dense(gate_up[0]), want) and torch.equal(_dense(down), mxfp4_dequantized(dq, ds))
            experts += 1
    assert experts > 0


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def transformers_greedy(directory: Path, family: str, ids: list[int]) -> list[int]:
    """transformers' greedy tokens on the dequantised checkpoint (whole-sequence forwards, the indexers' exact ties
    broken lowest position first as the runtime does)."""
    cls = tf.HYV4ForCausalLM if family == "hy_v4" else tf.Dots3NoteForCausalLM
    hf = cls.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    out: list[int] = []
    with _recorded_selections([float("inf")]):
        for _ in range(NEW_TOKENS):
            out.append(int(hf(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def test_batch_greedy_matches_transformers_on_the_dequantised_weights(checkpoint: dict[str, Any]) -> None:
    family = checkpoint["family"]
    want = [transformers_greedy(checkpoint["dequant"], family, p) for p in prompts()]
    llm = LLM(str(checkpoint["stored"]), dtype="float32", max_model_len=64, max_num_seqs=3)
    try:
        model = llm.engine.worker.own_model
        held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        held += sum(m.nbytes if isinstance(m, StoredLinear) else m.stored_bytes() for m in model.modules()
                    if isinstance(m, (StoredLinear, PackedExperts)))
        counted = llm.engine.worker.weight_bytes  # from the files' headers, as stored
        assert abs(counted - held) < 0.05 * held, (counted, held)
        full = sum(t.numel() * t.element_size() for t in LOADERS[family](checkpoint["float"]).state_dict().values())
        assert counted < 0.6 * full, (counted, full)  # not the float model's size
        raw = json.loads((checkpoint["stored"] / "config.json").read_text())
        plan = plan_rows(raw, dtype="float32", device_memory_bytes=1 << 30, checkpoint=checkpoint["stored"])
        assert plan.weight_bytes == plan.weight_bytes_per_rank == counted  # the planner counts what serving does
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()


def _altered(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _pack_experts_of(layer: str, name: str, scale: str) -> Callable[[dict[str, torch.Tensor]], None]:
    """Layer ``layer``'s stored down projections as one packed ``[E, N, K / 2]`` tensor ``name`` beside ``scale``
    (layouts not read)."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        names = sorted(n for n in t if n.startswith(f"{layer}.mlp.experts.") and ".down_proj." in n)
        weights = [t.pop(n) for n in names if n.endswith(".weight")]
        scales = [t.pop(n) for n in names if n.endswith("_scale_inv")]
        t[f"{layer}.mlp.experts.{name}"], t[f"{layer}.mlp.experts.{scale}"] = torch.stack(weights), torch.stack(scales)
    return edit


def test_layouts_and_formats_not_read_are_refused_by_name(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    family, src = checkpoint["family"], checkpoint["stored"]
    load = LOADERS[family]
    moe = next(n.split(".mlp.")[0] for n in checkpoint["written"] if ".mlp.experts." in n)
    packed = _altered(src, tmp_path / "packed", _pack_experts_of(moe, "down_proj", "down_proj_scale_inv"))
    with pytest.raises(ValueError, match=rf"{family}: {moe}\.mlp\.experts\.down_proj_scale_inv: .*packed"):
        load(packed)
    as_one = _altered(src, tmp_path / "one", _pack_experts_of(moe, "down_proj.weight", "down_proj.weight_scale_inv"))
    with pytest.raises(ValueError, match=rf"{family}: {moe}\.mlp\.experts\.down_proj\.weight is stored quantised "
                                         r"as \[4, 32, 16\]"):
        load(as_one)
    router = _altered(src, tmp_path / "router", lambda t: t.update({
        f"{moe}.mlp.gate.weight": t[f"{moe}.mlp.gate.weight"].to(torch.float8_e4m3fn),
        f"{moe}.mlp.gate.weight_scale_inv": torch.ones(1, 2)}))
    with pytest.raises(ValueError, match=rf"{family}: {moe}\.mlp\.gate\.weight is stored quantised"):
        load(router)
    fp8_expert = f"{moe}.mlp.experts.1.up_proj"
    as_fp8 = _altered(src, tmp_path / "fp8", lambda t: t.update({
        f"{fp8_expert}.weight": torch.zeros(32, 32).to(torch.float8_e4m3fn),
        f"{fp8_expert}.weight_scale_inv": torch.ones(4, 2)}))
    with pytest.raises(ValueError, match=rf"{family}: {fp8_expert}\.weight is stored as torch\.float8_e4m3fn; the "
                                         r"config's scheme stores routed experts as mxfp4"):
        load(as_fp8)
    raw = json.loads((src / "config.json").read_text())
    (tmp_path / "scheme").mkdir()
    shutil.copy(src / "model.safetensors", tmp_path / "scheme" / "model.safetensors")
    (tmp_path / "scheme" / "config.json").write_text(json.dumps(
        {**raw, "quantization_config": {**raw["quantization_config"], "expert_dtype": "nvfp4"}}))
    with pytest.raises(ValueError, match=rf"{family}: quantization_config not supported: expert_dtype 'nvfp4'"):
        load(tmp_path / "scheme")


def _greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    st, out = model.new_state(), []
    logits = model(prompt, st)[-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model([out[-1]], st)[-1]
    return out


def _held(model: torch.nn.Module) -> int:
    """Bytes a loaded model holds: its float tensors, and its stored matrices and experts as stored."""
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    return held + sum(m.nbytes if isinstance(m, StoredLinear) else m.stored_bytes() for m in model.modules()
                      if isinstance(m, (StoredLinear, PackedExperts)))


def test_two_ranks_give_one_ranks_tokens_on_a_stored_checkpoint(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """On blocks that the heads' and the MLPs' slices end on, two ranks (each its routed experts and its cut of the
    FP8 blocks, counted as the planner counts a rank's shard) give one rank's greedy tokens."""
    family, load = checkpoint["family"], LOADERS[checkpoint["family"]]
    stored = tmp_path / "stored"
    write_stored(checkpoint["float"], stored, tmp_path / "dequant", ue8m0=family == "dots3_note", block=(8, 8))
    one = load(stored)
    want = [_greedy(one, p, NEW_TOKENS) for p in prompts()]
    llm = LLM(str(stored), dtype="float32", max_model_len=64, kv_cache_memory="1MiB", max_num_seqs=3,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        w = llm.engine.worker
        held = _held(w.own_model)
        assert abs(w.weight_bytes - held) < 0.05 * held and held < 0.7 * _held(one), (w.weight_bytes, held)
        raw = json.loads((stored / "config.json").read_text())
        plan = plan_rows(raw, dtype="float32", device_memory_bytes=1 << 30, ranks=2, checkpoint=stored)
        assert plan.weight_bytes_per_rank == w.weight_bytes < plan.weight_bytes
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    parts = [load(stored, par=ParallelContext(r, 2)) for r in (0, 1)]
    o_proj = "model.layers.1.self_attn.o_proj"
    halves = [p.get_submodule(o_proj).blocks[0] for p in parts]
    assert all(isinstance(h, Fp8Weight) for h in halves)
    assert torch.equal(torch.cat([h.weight for h in halves], 1).view(torch.uint8),
                       one.get_submodule(o_proj).blocks[0].weight.view(torch.uint8))
    moe = next(n for n, m in one.named_modules() if isinstance(m, PackedExperts))
    whole, second = one.get_submodule(moe).stored, parts[1].get_submodule(moe).stored
    assert whole is not None and second is not None and len(second[1]) == len(whole[1]) // 2
    assert torch.equal(second[1][0].packed, whole[1][len(whole[1]) // 2].packed)  # rank 1's first expert: the middle


def test_a_rank_cut_inside_a_stored_block_is_refused_by_name(checkpoint: dict[str, Any]) -> None:
    """``BLOCK``'s 16 columns hold both heads' outputs: two ranks would cut ``o_proj`` inside its blocks."""
    family = checkpoint["family"]
    with pytest.raises(ValueError, match=rf"{family}: tensor_parallel_size=2 cuts model\.layers\.\d+\.\S+ input "
                                         r"columns \[\d+, \d+\) off its stored blocks \(Fp8Weight \(8, 16\)\)"):
        LOADERS[family](checkpoint["stored"], par=ParallelContext(1, 2))
