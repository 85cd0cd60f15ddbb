"""DeepSeek-V4 checkpoints as they ship (``models/v4_stored.py``): a tiny V4 built by transformers' classes, its
attention, output and shared-expert projections written as block-FP8 (e4m3, UE8M0 block scales under ``X.scale``)
and its routed experts as MXFP4 (int8 bytes of two E2M1 nibbles, a UE8M0 scale per 32), the compressors' and the
indexer's ``wkv``/``wgate``/``weights_proj`` left in float as the released checkpoints leave them. The runtime loads
it as stored and its greedy tokens and logits are transformers' on the dequantised weights (the writer's
dequantisation is checked equal to transformers' own ``Fp8Dequantize``); the weights stay one byte / half a byte;
FP8 experts with float32 ``weight_scale_inv`` load too; other schemes and stray tensors are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mla_runtime import LLM, SamplingParams
from mla_runtime.layers.fp4 import Mxfp4Weight
from mla_runtime.layers.fp8 import Fp8Weight
from mla_runtime.layers.hyper import StoredLinear
from mla_runtime.models.deepseek_v4 import DeepseekV4ForCausalLM, load_deepseek_v4
from mla_runtime.models.v4_stored import v4_quantization
from tests.checkpoints import VOCAB
from tests.test_families_v4 import build

BLOCK = (32, 16)  # several blocks each way in the tiny model's matrices (the released checkpoints' are 128 x 128)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FLOAT_KEPT = (".compressor.wkv.", ".compressor.wgate.", ".indexer.weights_proj.")  # BF16 in V4-Flash
PROMPT_LENS, NEW_TOKENS = (45, 19), 8


def quantized_names(name: str, head: bool) -> str | None:
    """``fp8``, ``experts`` or None (kept float) for a checkpoint tensor's released name (``head``: the lm_head
    quantised too)."""
    if name == "head.weight":
        return "fp8" if head else None
    if not name.endswith(".weight") or any(k in name for k in FLOAT_KEPT) or ".layers." not in "." + name:
        return None
    if ".ffn.experts." in name:
        return "experts"
    if ".attn." in name or ".shared_experts." in name:
        return None if name.endswith("norm.weight") else "fp8"
    return None


def fp8_blocks(w: torch.Tensor, ue8m0: bool, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> e4m3 values and one scale per ``block`` (UE8M0: the next power of two of amax / 448)."""
    bn, bk = block
    n, k = w.shape
    amax = w.abs().reshape(n // bn, bn, k // bk, bk).amax(dim=(1, 3))
    scale = amax / 448.0
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    wide = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
    q = (w / wide).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu) if ue8m0 else scale.float()


def fp8_dequantized(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    return q.float() * scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> int8 ``[N, K / 2]`` (value ``2i`` in the low nibble) and UE8M0 scales ``[N, K / 32]``
    (the OCP rule: ``floor(log2(amax)) - 2``; each value to the nearest E2M1)."""
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1))) - 2
    scaled = groups / torch.exp2(exp).unsqueeze(-1)
    mag = (scaled.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)
    codes = (mag | (torch.signbit(scaled).long() << 3)).reshape(n, k).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def mxfp4_dequantized(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u = packed.view(torch.uint8).long()
    codes = torch.stack([u & 15, u >> 4], dim=-1).flatten(1)
    values = torch.cat([E2M1, -E2M1])[codes]
    return values * torch.exp2(scale.view(torch.uint8).float() - 127).repeat_interleave(32, 1)


def write_stored(float_dir: Path, stored_dir: Path, dequant_dir: Path, experts: str, ue8m0: bool,
                 block: tuple[int, int] = BLOCK) -> None:
    """``float_dir`` (transformers' save) -> ``stored_dir`` in the released quantised layout (no ``model.``
    prefix; scales as ``X.scale`` for UE8M0, ``X.weight_scale_inv`` for float32) and ``dequant_dir``: the same
    float checkpoint with every quantised tensor replaced by its dequantisation."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(str(next(float_dir.glob("*.safetensors"))))
    stored, dequant = {}, dict(tensors)
    for name, w in tensors.items():
        bare = name.removeprefix("model.")
        kind = quantized_names(bare, head=experts == "fp8")
        if kind is None:
            stored[bare] = w
            continue
        fp4 = kind == "experts" and experts == "fp4"
        q, s = mxfp4(w.float()) if fp4 else fp8_blocks(w.float(), ue8m0, block)
        dequant[name] = (mxfp4_dequantized(q, s) if fp4 else fp8_dequantized(q, s, block)).to(w.dtype)
        # the writer's dequantisation is transformers' own
        assert torch.equal(Fp8Dequantize(None)._dequantize_one(q, s, w.dtype), dequant[name]), name
        stored[bare] = q
        stored[bare[:-len("weight")] + ("scale" if ue8m0 else "weight_scale_inv")] = s
    for d, ts in ((stored_dir, stored), (dequant_dir, dequant)):
        d.mkdir(parents=True, exist_ok=True)
        save_file(ts, str(d / "model.safetensors"))
    raw = json.loads((float_dir / "config.json").read_text())
    shutil.copy(float_dir / "config.json", dequant_dir / "config.json")
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": "ue8m0" if ue8m0 else "float"}
    raw["expert_dtype"] = experts  # beside the quantization config, as V4 ships it
    (stored_dir / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4_stored")
    out = {k: root / k for k in ("float", "fp4", "fp4_dequant", "fp8", "fp8_dequant")}
    build().save_pretrained(out["float"])
    write_stored(out["float"], out["fp4"], out["fp4_dequant"], "fp4", ue8m0=True)
    write_stored(out["float"], out["fp8"], out["fp8_dequant"], "fp8", ue8m0=False)
    return out


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_released_layout_matches_transformers_on_the_dequantised_weights(dirs: dict[str, Path]) -> None:
    import transformers as tf

    hf = tf.DeepseekV4ForCausalLM.from_pretrained(dirs["fp4_dequant"], dtype=torch.float32).eval()
    ours = load_deepseek_v4(dirs["fp4"])
    for p in prompts():
        with torch.no_grad():
            ref_logits = hf(torch.tensor([p])).logits[0].float()
        mine = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
        assert torch.allclose(mine, ref_logits, atol=1e-4, rtol=1e-4), (mine - ref_logits).abs().max().item()
    p = prompts()[0]  # past the window and the indexer's top-k; prefilled in chunks of 15
    with torch.no_grad():
        ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS)
    assert ours.generate_greedy(p, NEW_TOKENS, chunk=15) == ids[0, len(p):].tolist()


def _stored_bytes(model: DeepseekV4ForCausalLM) -> tuple[int, int]:
    """(bytes of the model's float parameters and buffers, bytes of its stored matrices)."""
    floats = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    stored = sum(m.nbytes if isinstance(m, StoredLinear) else m.stored_bytes() for m in model.modules()
                 if isinstance(m, StoredLinear) or hasattr(m, "stored_bytes"))
    return floats, stored


def test_weights_stay_as_stored(dirs: dict[str, Path]) -> None:
    ours = load_deepseek_v4(dirs["fp4"], dtype=torch.bfloat16)
    attn = ours.model.layers[3].self_attn
    for proj in (attn.q_a_proj, attn.q_b_proj, attn.kv_proj, attn.o_b_proj, attn.compressor.indexer.q_b_proj):
        assert isinstance(proj, StoredLinear) and isinstance(proj.blocks[0], Fp8Weight)
        assert proj.blocks[0].weight.dtype == torch.float8_e4m3fn and proj.nbytes < 2 * proj.weight.numel()
    assert isinstance(attn.o_a_proj, StoredLinear) and len(attn.o_a_proj.blocks) == 2  # one block of rows a group
    assert isinstance(attn.compressor.kv_proj, torch.nn.Linear)  # left in float by the checkpoint
    assert attn.compressor.kv_proj.weight.dtype == torch.bfloat16
    experts = ours.model.layers[2].mlp.experts
    assert experts.stored is not None and not hasattr(experts, "gate_up_proj")
    gate_up, down = experts.stored[0][0], experts.stored[1][0]
    assert [type(m) for m in gate_up] == [Mxfp4Weight] and gate_up[0].shape == (64, 64)  # gate and up stacked
    assert isinstance(down, Mxfp4Weight) and down.packed.dtype == torch.uint8 and down.packed.shape == (64, 16)
    assert down.nbytes == 64 * 32 // 2 + 64  # half a byte a value, a byte per 32
    floats, stored = _stored_bytes(ours)
    full = _stored_bytes(load_deepseek_v4(dirs["float"], dtype=torch.bfloat16))[0]
    assert stored > 0 and floats + stored < full - stored  # the stored matrices take less than half their bf16
    # in bfloat16 too, the stored products are the dequantised weights' (exact in bfloat16: 3 or 1 mantissa bits)
    ref, p = load_deepseek_v4(dirs["fp4_dequant"], dtype=torch.bfloat16), prompts()[0]
    a = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
    b = ref.compute_logits(ref(torch.tensor(p), ref.new_state()))
    assert torch.allclose(a, b, atol=3e-2), (a - b).abs().max().item()


def test_the_planner_counts_the_weights_as_stored(dirs: dict[str, Path]) -> None:
    """``mla-runtime plan`` on a stored checkpoint folder counts its weights as the worker does (from the files'
    headers), on one rank and per rank of two; on the float folder, and a preset, as the model's parameters."""
    from mla_runtime.models.v4_stored import stored_weight_bytes
    from mla_runtime.parallel import ParallelContext
    from mla_runtime.v4_plan import plan_v4

    raw = json.loads((dirs["fp8"] / "config.json").read_text())
    cfg = load_deepseek_v4(dirs["fp8"]).config
    kw: dict[str, Any] = dict(dtype="float32", device_memory_bytes=1 << 30)
    one = plan_v4(raw, checkpoint=dirs["fp8"], **kw)
    assert one.weight_bytes == one.weight_bytes_per_rank == stored_weight_bytes(dirs["fp8"], torch.float32)
    two = plan_v4(raw, checkpoint=dirs["fp8"], ranks=2, **kw)
    assert two.weight_bytes_per_rank == stored_weight_bytes(dirs["fp8"], torch.float32, cfg, ParallelContext(0, 2))
    float_raw = json.loads((dirs["float"] / "config.json").read_text())
    assert plan_v4(float_raw, checkpoint=dirs["float"], **kw).weight_bytes == plan_v4(float_raw, **kw).weight_bytes
    assert one.weight_bytes < 0.6 * plan_v4(float_raw, **kw).weight_bytes


def test_fp8_experts_with_float_scales(dirs: dict[str, Path]) -> None:
    """FP8 experts (``expert_dtype`` fp8), float32 ``weight_scale_inv`` and an FP8 lm_head: the runtime's logits on
    the stored weights are its logits on the dequantised ones (which the float tests hold to transformers')."""
    ours, ref = load_deepseek_v4(dirs["fp8"]), load_deepseek_v4(dirs["fp8_dequant"])
    assert isinstance(ours.model.layers[0].mlp.experts.stored[1][0], Fp8Weight)
    assert isinstance(ours.lm_head, StoredLinear)
    for p in prompts():
        a = ours.compute_logits(ours(torch.tensor(p), ours.new_state()))
        b = ref.compute_logits(ref(torch.tensor(p), ref.new_state()))
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max().item()


def test_served_by_the_engine(dirs: dict[str, Path]) -> None:
    ours = load_deepseek_v4(dirs["fp4"])
    want = [ours.generate_greedy(p, 4) for p in prompts()]
    llm = LLM(str(dirs["fp4"]), dtype="float32", max_model_len=64, max_num_seqs=2)
    try:
        held = sum(_stored_bytes(ours))  # the worker counts the weights as stored, from the files' headers
        assert abs(llm.engine.worker.weight_bytes - held) < 0.05 * held, (llm.engine.worker.weight_bytes, held)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()


@pytest.mark.parametrize("change, named", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"expert_dtype": "nvfp4"}, "expert_dtype 'nvfp4'"),
    ({"activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"weight_block_size": [128]}, "weight_block_size [128]"),
])
def test_other_schemes_are_refused_by_name(change: dict[str, Any], named: str) -> None:
    q = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4", **change}
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        v4_quantization({"quantization_config": q})


def _altered(src: Path, dst: Path, edit: Any) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_stray_and_mismatched_tensors_are_refused_by_name(dirs: dict[str, Path], tmp_path: Path) -> None:
    no_scale = _altered(dirs["fp4"], tmp_path / "a", lambda t: t.pop("layers.1.attn.wq_a.scale"))
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight.*without a scale"):
        load_deepseek_v4(no_scale)
    wrong = _altered(dirs["fp4"], tmp_path / "s", lambda t: t.update(
        {"layers.1.attn.wq_a.scale": torch.ones(2, 2).to(torch.float8_e8m0fnu)}))
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_a\.weight: .*scales \[1, 4\]"):
        load_deepseek_v4(wrong)
    raw = json.loads((dirs["fp4"] / "config.json").read_text())
    (tmp_path / "b").mkdir()
    shutil.copy(dirs["fp4"] / "model.safetensors", tmp_path / "b" / "model.safetensors")
    (tmp_path / "b" / "config.json").write_text(json.dumps({**raw, "expert_dtype": "fp8"}))
    with pytest.raises(ValueError, match=r"experts\.0\.w1\.weight is stored as torch\.int8"):
        load_deepseek_v4(tmp_path / "b")
    router = _altered(dirs["fp4"], tmp_path / "c", lambda t: t.update({
        "layers.2.ffn.gate.weight": t["layers.2.ffn.gate.weight"].to(torch.float8_e4m3fn),
        "layers.2.ffn.gate.scale": torch.ones(1, 4)}))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.gate\.weight is stored quantised"):
        load_deepseek_v4(router)


def _dense(m: Any) -> torch.Tensor:
    """A ``StoredLinear``'s (or a stored matrix's) float weight ``[N, K]``, by its product with the identity."""
    blocks = m.blocks if isinstance(m, StoredLinear) else [m]
    eye = torch.eye(blocks[0].shape[1])
    return torch.cat([b.matmul(eye, None) for b in blocks], dim=-1).T


def test_each_rank_loads_its_shard_as_stored(dirs: dict[str, Path]) -> None:
    """Two ranks' shards of the FP8 checkpoint (FP8 experts and head): each rank's heads, output groups, shared
    expert slice and vocabulary rows are those of the whole model's stored matrices (cut on the scale blocks, or a
    scale row per row where the rows end inside a block), its experts whole, its bytes what the headers say."""
    from mla_runtime.models.v4_stored import stored_weight_bytes
    from mla_runtime.parallel import ParallelContext

    whole = load_deepseek_v4(dirs["fp8"])
    for rank in (0, 1):
        par = ParallelContext(rank, 2)
        mine = load_deepseek_v4(dirs["fp8"], par=par)
        for layer, full in zip(mine.model.layers, whole.model.layers):
            a, b = layer.self_attn, full.self_attn
            for name, dim in (("q_b_proj", 0), ("o_a_proj", 0), ("o_b_proj", 1)):
                want = _dense(getattr(b, name)).chunk(2, dim=dim)[rank]
                assert torch.equal(_dense(getattr(a, name)), want), name
            assert torch.equal(a.sinks, b.sinks.chunk(2)[rank]) and torch.equal(_dense(a.kv_proj), _dense(b.kv_proj))
            s, t = layer.mlp.shared_experts, full.mlp.shared_experts
            assert torch.equal(_dense(s.gate_proj), _dense(t.gate_proj).chunk(2)[rank])
            assert torch.equal(_dense(s.down_proj), _dense(t.down_proj).chunk(2, dim=1)[rank])
            down, full_down = layer.mlp.experts.stored[1], full.mlp.experts.stored[1]
            assert len(down) == 2 and all(torch.equal(_dense(d), _dense(full_down[2 * rank + e]))
                                          for e, d in enumerate(down))
        assert torch.equal(_dense(mine.lm_head), _dense(whole.lm_head).chunk(2)[rank])
        held = sum(_stored_bytes(mine))
        counted = stored_weight_bytes(dirs["fp8"], torch.float32, whole.config, par)
        assert abs(counted - held) < 0.05 * held, (counted, held)
