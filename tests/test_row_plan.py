"""The plan of Hunyuan V4 and dots3-note (``row_plan.py``, ``models/row_sizes.py``) on tiny configs written by
transformers' own classes: the per-token and per-sequence bytes against what a sequence's state holds after a
prompt, the weights against the model's parameters, both against the workers' start-up numbers, and ``mla-runtime
plan``'s report and exit codes (fits, does not fit, weights do not fit, quantization and a rank count that does not
split the model refused); on two ranks a rank's weights are its shard's, as the worker of rank 0 counts them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mla_runtime.engine.config import EngineConfig
from mla_runtime.engine.dots3_worker import Dots3Worker
from mla_runtime.engine.hy_v4_worker import HyV4Worker
from mla_runtime.models.dots3_note import Dots3Config, Dots3NoteForCausalLM
from mla_runtime.models.hy_v4 import HyV4Config, HyV4ForCausalLM
from mla_runtime.parallel import ParallelContext
from mla_runtime.plan_cli import main
from mla_runtime.row_plan import plan_rows
from tests.conformance import dots3_note_multimodal
from tests.test_families_dots3_note import TEXT as DOTS
from tests.test_families_hy_v4 import TEXT as HY

tf = pytest.importorskip("transformers")
FAMILIES = {"hy_v4": (HyV4Config, HyV4ForCausalLM, HyV4Worker),
            "dots3_note": (Dots3Config, Dots3NoteForCausalLM, Dots3Worker)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's ``config.json`` as transformers writes it (dots3-note: the multimodal wrapper, as shipped)."""
    out = {}
    for family, config in (("hy_v4", tf.HYV4Config(**HY)), ("dots3_note", dots3_note_multimodal(DOTS))):
        out[family] = tmp_path_factory.mktemp(family)
        config.save_pretrained(out[family])
    return out


def _raw(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _state_bytes(state: object) -> int:
    return sum(t.nbytes for t in (*state.latents, *state.index_keys))  # type: ignore[attr-defined]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_bytes_are_what_a_sequence_keeps_and_the_worker_counts(checkpoints, family):
    """A sequence's state after 12 and 17 tokens (past dots3-note's window of 5) holds the plan's bytes; the model's
    parameters are the plan's weights; the worker starts with the same numbers."""
    config_of, model_of, worker_of = FAMILIES[family]
    raw = _raw(checkpoints[family])
    plan = plan_rows(raw, dtype="bfloat16", device_memory_bytes=2**30, max_seq_len=17)
    torch.manual_seed(0)
    model = model_of(config_of.from_raw(raw), torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    state = model.new_state()
    model(list(range(1, 13)), state)
    assert _state_bytes(state) == plan.kinds.sequence_bytes(12)
    model(list(range(1, 6)), state)
    assert _state_bytes(state) == plan.kinds.sequence_bytes(17) == plan.sequence_bytes
    assert plan.weight_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert plan.parameter_count == sum(p.numel() for p in model.parameters())
    worker = worker_of(EngineConfig(model=str(checkpoints[family]), dtype="bfloat16"))
    assert worker.bytes_per_token == plan.kinds.bytes_per_token
    assert worker.state_bytes_per_sequence == plan.kinds.window_bytes
    assert worker.weight_bytes == plan.weight_bytes
    n = worker.config.max_num_seqs  # prefix caching's state snapshots: the windows again, one per slot
    assert worker.state_snapshot_bytes == plan_rows(raw, dtype="bfloat16", device_memory_bytes=2**30,
                                                    max_num_seqs=n).reserved_bytes == n * plan.kinds.window_bytes
    assert (plan.kinds.window_bytes > 0) == (family == "dots3_note")  # only dots3-note has sliding layers
    two = plan_rows(raw, dtype="bfloat16", device_memory_bytes=2**30, max_seq_len=17, ranks=2)
    rank0 = worker_of(EngineConfig(model=str(checkpoints[family]), dtype="bfloat16", tensor_parallel_size=2),
                      ParallelContext(0, 2))
    shard = model_of(config_of.from_raw(raw), torch.bfloat16, ParallelContext(0, 2))
    assert two.weight_bytes_per_rank == rank0.weight_bytes == sum(p.numel() * p.element_size()
                                                                  for p in shard.parameters()) < plan.weight_bytes
    assert two.weight_bytes == plan.weight_bytes and two.sequence_bytes == plan.sequence_bytes


def _cli(checkpoint: Path, *args: str) -> int:
    return main(["--model", str(checkpoint), "--max-seq-len", "64", *args])


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_cli_reports_the_kinds_and_exits_as_v4s(checkpoints, family, capsys):
    plan = plan_rows(_raw(checkpoints[family]), device_memory_bytes=2**30, max_seq_len=64, max_num_seqs=2)
    assert _cli(checkpoints[family], "--device-memory", "1GiB", "--max-num-seqs", "2") == 0
    out = capsys.readouterr().out
    assert f"Memory plan for {checkpoints[family]} ({family}: " in out
    assert "latent rows (every token)" in out and "indexer keys (every token)" in out
    assert f"{plan.kinds.bytes_per_token:,} B/token" in out and f"{plan.weight_bytes:,} B" in out
    assert ("sliding windows per sequence" in out) == (family == "dots3_note")
    assert "a plain MLA stack of the same layers" in out and f"FITS ({plan.max_sequences:,} fit)" in out
    over = plan_rows(_raw(checkpoints[family]), device_memory_bytes=2**30, max_seq_len=64,
                     max_num_seqs=plan.max_sequences + 1)  # more sequences: a larger reserve, fewer fit
    assert _cli(checkpoints[family], "--device-memory", "1GiB", "--max-num-seqs", str(over.max_num_seqs)) == 1
    assert f"DOES NOT FIT ({over.max_sequences:,} fit)" in capsys.readouterr().out
    assert _cli(checkpoints[family], "--device-memory", "200MiB") == 2  # the activation reserve alone is 256 MiB
    assert "the weights and activations alone DO NOT FIT" in capsys.readouterr().out
    for refused, name in ((["--quantization", "int8"], "quantization='int8'"),
                          (["--cache-dtype", "fp8"], "kv_cache_dtype='fp8'"),
                          (["--kv-cache-host-bytes", "1GiB"], "kv_cache_host_bytes=")):
        assert _cli(checkpoints[family], "--device-memory", "1GiB", *refused) == 2
        err = capsys.readouterr().err
        assert name in err and f"{family} runs with every rank holding every sequence's state" in err
    assert _cli(checkpoints[family], "--device-memory", "1GiB", "--tensor-parallel-size", "3") == 2
    assert f"tensor_parallel_size=3 cannot split this {family} model" in capsys.readouterr().err
    assert _cli(checkpoints[family], "--device-memory", "1GiB", "--tensor-parallel-size", "2") == 0


def test_float32_and_a_bad_dtype(checkpoints):
    raw = _raw(checkpoints["hy_v4"])
    half = plan_rows(raw, device_memory_bytes=2**30)
    full = plan_rows(raw, dtype="float32", device_memory_bytes=2**30)
    assert full.kinds.bytes_per_token == 2 * half.kinds.bytes_per_token
    assert half.weight_bytes < full.weight_bytes < 2 * half.weight_bytes + 1  # its lm_head is float32 in both
    assert half.max_seq_len == raw["max_position_embeddings"]  # the default: the model's whole context
    with pytest.raises(ValueError, match="dtype: hy_v4 runs in"):
        plan_rows(raw, dtype="float16", device_memory_bytes=2**30)
