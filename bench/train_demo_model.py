"""Train a small, real MLA model (DeepSeek-V3 architecture) that writes Python-like text.

Exact command used for the committed checkpoint in ``mla_runtime/demo_model/`` (see bench/RESULTS_demo.md):

    python bench/train_demo_model.py --out mla_runtime/demo_model --steps 900 --seed 0 --threads 2

(from the repository root; these are also the defaults). About 15 min on 2 otherwise idle cores (0.96 s per
step); the recorded run took 52 min because two other jobs were competing for the same 2 cores.

Everything runs offline on CPU:

1. Corpus: the ``.py`` sources of this interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
   paths sorted, skipping test directories (``test``, ``tests``, ``idle_test``), ``site-packages``,
   ``__pycache__``, data blobs over 400 KB and generated codec tables (``gencodec.py`` output), capped
   at ``--max-corpus-mb``. Every 20th file (index % 20 == 19) is held out for evaluation; neither the
   tokenizer nor the model sees those files.
2. Tokenizer: byte-level BPE (``tokenizers``), ``--vocab`` entries including ``<|bos|>``, ``<|eos|>``,
   ``<|pad|>``, saved in Hugging Face format (``AutoTokenizer.from_pretrained(out)`` works offline). The
   tokenizer prepends ``<|bos|>``; every training document is ``<|bos|> file <|eos|>``.
3. Model: ``transformers.DeepseekV3ForCausalLM`` from scratch -- MLA attention (kv_lora_rank 128,
   q_lora_rank 128, qk_nope 32 + qk_rope 16, v 32, interleaved RoPE), first layer dense, the rest MoE with
   4 routed experts (sigmoid router, top-2) + 1 shared expert. Router load is balanced the DeepSeek-V3 way
   (auxiliary-loss-free: the ``e_score_correction_bias`` of each router is nudged towards uniform load
   after every step). AdamW, linear warm-up + cosine decay, grad clipping, sequence length 256, bf16
   autocast for the forward pass (weights and optimizer state in fp32).
4. Save: ``save_pretrained`` (safetensors, weights in bfloat16 except the fp32 router) + tokenizer.
5. Evaluate: the *saved* checkpoint is reloaded with ``AutoModelForCausalLM`` (fp32 compute) and scored on
   a fixed number of held-out tokens (perplexity per token and bits per byte); a greedy and a temperature
   sample are printed.

Deterministic for a given ``--seed`` / ``--threads`` / ``--steps`` (CPU kernels are deterministic; the thread
count changes reduction order). ``--minutes`` optionally stops training early at a wall-clock budget (the
default, 0, trains for exactly ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
MAX_FILE_BYTES = 400_000  # pydoc_data/topics.py and similar are documentation blobs, not code
GENERATED_MARK = "gencodec.py"  # machine-generated codec tables (encodings/cp*.py, ...): data, not code
HOLDOUT_EVERY = 20
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- corpus
def list_sources(root: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                files.append(Path(dirpath) / name)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def build_corpus(max_mb: float) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, heldout) lists of (relative path, text); every HOLDOUT_EVERY-th kept file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout, total = [], [], 0
    kept = 0
    for path in list_sources(root):
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or len(raw) > MAX_FILE_BYTES or GENERATED_MARK in text:
            continue
        if total + len(raw) > max_mb * 1e6:
            break
        total += len(raw)
        rel = path.relative_to(root).as_posix()
        (heldout if kept % HOLDOUT_EVERY == HOLDOUT_EVERY - 1 else train).append((rel, text))
        kept += 1
    log(f"corpus: {root} -> {kept} files, {total / 1e6:.2f} MB "
        f"(train {len(train)} files, held-out {len(heldout)} files)")
    return train, heldout


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos = tok.token_to_id("<|bos|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
        clean_up_tokenization_spaces=False, model_max_length=2048,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    return hf


def encode_docs(tok, docs: list[tuple[str, str]]):
    import torch

    bos, eos = tok.bos_token_id, tok.eos_token_id
    enc = tok.backend_tokenizer.encode_batch([t for _, t in docs], add_special_tokens=False)
    ids = []
    for e in enc:
        ids.append(bos)
        ids.extend(e.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------ model
def make_config(vocab_size: int, tok):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,          # dense MLP of layer 0
        moe_intermediate_size=256,      # each routed / shared expert
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        num_mtp_layers=0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


class RouterBalancer:
    """DeepSeek-V3 auxiliary-loss-free balancing: bias_e += rate * sign(mean_load - load_e) per step."""

    def __init__(self, model, rate: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = [None] * len(self.routers)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(self._hook(i))

    def _hook(self, i):
        import torch

        def hook(module, args, output):
            if module.training:
                counts = torch.bincount(output[2].reshape(-1), minlength=module.num_experts).float()
                self.loads[i] = counts if self.loads[i] is None else self.loads[i] + counts
        return hook

    def step(self) -> list[list[float]]:
        import torch

        fractions = []
        with torch.no_grad():
            for r, load in zip(self.routers, self.loads):
                if load is None:
                    continue
                r.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
                fractions.append((load / load.sum()).tolist())
        self.loads = [None] * len(self.routers)
        return fractions


# Keys of the official DeepSeek-V3 config.json that transformers 5 leaves out; readers that predate
# ``rope_parameters`` (transformers 4.x, vLLM/SGLang-style loaders) look for them.
COMPAT_CONFIG = {"rope_theta": 10000.0, "rope_scaling": None, "topk_method": "noaux_tc",
                 "scoring_func": "sigmoid", "moe_layer_freq": 1, "torch_dtype": "bfloat16"}


def patch_json(path: Path, extra: dict) -> None:
    data = json.loads(path.read_text())
    data.update(extra)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def lr_at(step: int, steps: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_windows(stream, seq_len: int, n_windows: int):
    """Fixed, non-overlapping windows of seq_len+1 tokens from the start of the held-out stream."""
    n = min(n_windows, (len(stream) - 1) // seq_len)
    return [stream[i * seq_len: i * seq_len + seq_len + 1].long() for i in range(n)]


def mean_nll(model, windows, batch: int, autocast: bool) -> float:
    import torch
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for i in range(0, len(windows), batch):
            x = torch.stack(windows[i: i + batch])
            logits = model(input_ids=x[:, :-1]).logits.float()
            nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
            total += nll.item()
            count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="mla_runtime/demo_model", help="checkpoint folder (replaced)")
    ap.add_argument("--steps", type=int, default=900, help="optimizer steps (default schedule length)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--minutes", type=float, default=0.0,
                    help="optional wall-clock training budget; 0 = train exactly --steps steps")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--max-corpus-mb", type=float, default=60.0)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored at the end")
    ap.add_argument("--eval-every", type=int, default=150)
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    # ---- data + tokenizer
    train_docs, heldout_docs = build_corpus(args.max_corpus_mb)
    tok = train_tokenizer([t for _, t in train_docs], args.vocab, out)
    train_ids = encode_docs(tok, train_docs)
    held_ids = encode_docs(tok, heldout_docs)
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    log(f"tokenizer: vocab {len(tok)}; train {len(train_ids):,} tokens ({train_bytes / len(train_ids):.2f} "
        f"bytes/token), held-out {len(held_ids):,} tokens  [{time.time() - t_start:.0f}s]")

    # ---- model
    config = make_config(len(tok), tok)
    model = DeepseekV3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"model: {n_params:,} parameters ({n_params - n_embed:,} without embeddings / lm_head)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = RouterBalancer(model, rate=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    val_windows = eval_windows(held_ids, args.seq_len, 16)
    L = args.seq_len
    curve = []

    model.train()
    t_train = time.time()
    step = 0
    ema = None
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - L - 1, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s: s + L + 1] for s in starts.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        load = balancer.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        elapsed = time.time() - t_train
        last = step == args.steps - 1 or (args.minutes and elapsed > args.minutes * 60)
        if step % 25 == 0 or last:
            maxload = max(max(f) for f in load)
            log(f"step {step:5d}/{args.steps}  loss {loss.item():.3f} (ema {ema:.3f})  lr {lr:.2e}  "
                f"gnorm {gnorm:.2f}  max expert load {maxload:.2f}  "
                f"{(step + 1) * args.batch * L / elapsed:,.0f} tok/s  {elapsed / 60:.1f} min")
        if (step + 1) % args.eval_every == 0 or last:
            val = mean_nll(model, val_windows, 8, autocast=True)
            curve.append((step + 1, ema, val))
            log(f"  eval step {step + 1}: train loss (ema) {ema:.3f}  held-out loss {val:.3f} "
                f"(ppl {math.exp(val):.1f})")
        if last:
            break
    steps_done = step + 1
    train_s = time.time() - t_train

    # ---- save: bf16 weights (router gate + correction bias stay fp32)
    model.eval()
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            continue
        for p in mod.parameters(recurse=False):
            p.data = p.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    patch_json(out / "config.json", COMPAT_CONFIG)
    patch_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log(f"saved {out} ({size / 1e6:.2f} MB): {sorted(f.name for f in out.iterdir())}")

    # ---- evaluate the saved checkpoint
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    windows = eval_windows(held_ids, L, args.eval_tokens // L)
    n_tok = len(windows) * L
    nll = mean_nll(model, windows, 8, autocast=False)
    scored = torch.cat([w[1:] for w in windows]).tolist()
    n_bytes = len(tok.decode(scored).encode("utf-8"))
    bpb = nll * n_tok / n_bytes / math.log(2)
    log(f"held-out: {n_tok:,} tokens ({n_bytes:,} bytes) from {len(heldout_docs)} files: "
        f"loss {nll:.4f}  perplexity {math.exp(nll):.2f}  bits/byte {bpb:.3f}  (uniform ppl {len(tok)})")

    samples = {}
    for name, prompt, kw in [
        ("greedy", "def ", dict(do_sample=False)),
        ("sample (T=0.8, top-k 40)", "import os\n", dict(do_sample=True, temperature=0.8, top_k=40)),
    ]:
        torch.manual_seed(args.seed)
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen_ids = model.generate(**enc, max_new_tokens=160, pad_token_id=tok.pad_token_id, **kw)
        text = tok.decode(gen_ids[0], skip_special_tokens=True)
        samples[name] = {"prompt": prompt, "text": text}
        print(f"\n===== {name}, prompt {prompt!r} =====\n{text}\n=====", flush=True)

    summary = {
        "steps": steps_done, "seed": args.seed, "threads": args.threads, "params": n_params,
        "folder_bytes": size, "train_seconds": round(train_s, 1), "total_seconds": round(time.time() - t_start, 1),
        "heldout_tokens": n_tok, "heldout_loss": nll, "heldout_ppl": math.exp(nll), "heldout_bits_per_byte": bpb,
        "curve": curve, "samples": samples, "torch": torch.__version__, "python": sys.version.split()[0],
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    log(f"done in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
