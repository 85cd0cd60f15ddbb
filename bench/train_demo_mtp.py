"""Train a multi-token-prediction (MTP) head for the committed demo model, its main weights frozen.

Exact command used for the committed ``mla_runtime/demo_model/mtp.safetensors`` (see bench/RESULTS_demo.md):

    OMP_WAIT_POLICY=PASSIVE python bench/train_demo_mtp.py --model mla_runtime/demo_model --steps 1600 --seed=0 \
        --threads 2 --cpu-minutes 40 --eval-every 400

(from the repository root; the recorded run wrote to a copy of the folder). ``--cpu-minutes 40`` bounds the loop at
20 minutes of 2 busy cores; ``OMP_WAIT_POLICY=PASSIVE`` keeps idle OpenMP threads from spinning, so that on a
shared machine the budget counts work, not waiting.


The head is DeepSeek-V3's MTP module, stored the way DeepSeek-V3 checkpoints store it: one more layer
``model.layers.{num_hidden_layers}.*`` after the decoder layers, holding ``enorm``, ``hnorm``, ``eh_proj``, a
full decoder block (MLA + MoE, because its index is past ``first_k_dense_replace``) and ``shared_head.norm``.
Embeddings and ``shared_head.head`` are the main model's (not stored: the runtime shares them). For position
``i`` it reads the main model's last hidden state ``h_i`` (after the final norm) and the embedding of the next
token ``t_{i+1}`` and predicts ``t_{i+2}``:

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]),   logits = head(shared_head.norm(block(x_i)))

Training, on the same corpus and split as ``bench/train_demo_model.py``:

- the main model (frozen, no gradients; fp32 unless ``--bf16``) gives ``h`` and its own next-token distributions;
- the head is distilled towards the main model, which is what a speculative draft has to match: the soft
  cross-entropy between the head's distribution at ``i`` and the main model's at ``i + 1`` (depth 1);
- depth 2 trains the chained use (``k > 1`` drafts): the head runs once more on its own depth-1 output
  ``x'_i`` and the token ``t_{i+2}`` at position ``i + 1``, attending to the depth-1 keys of positions
  ``0..i`` and to its own key, exactly as the runtime's second draft does (its depth-1 latent rows are in
  the cache), and is distilled towards the main model at ``i + 2``;
- the schedule (warm-up, cosine) runs over ``--steps``, or over the time budget when that ends the run first;
- the block starts as a copy of the main model's last layer, ``eh_proj`` as ``[0 ; I]`` plus noise,
  ``shared_head.norm`` as the final norm; router balance as in the main script.

Reported at the end: held-out top-1 agreement of the head with the main model's next-next token at depth 1
and 2 (what greedy acceptance measures), and its perplexity on the corpus's next-next token.
Deterministic for a given ``--seed`` / ``--threads`` / ``--steps`` unless ``--minutes`` stops it first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_model import RouterBalancer, build_corpus, encode_docs, eval_windows, log, lr_at  # noqa: E402

MTP_FILE = "mtp.safetensors"


def make_head(config, layer_idx: int):
    import torch
    from torch import nn
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    class MTPLayer(DeepseekV3DecoderLayer):
        """A decoder block plus DeepSeek-V3's MTP parts; parameter names are the checkpoint's."""

        def __init__(self) -> None:
            super().__init__(config, layer_idx)
            h = config.hidden_size
            self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
            self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)

        def fuse(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
            return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    return MTPLayer()


def init_head(head, model) -> None:
    import torch

    last = model.model.layers[-1]
    own = head.state_dict()
    for name, value in last.state_dict().items():
        own[name].copy_(value)
    head.shared_head.norm.weight.data.copy_(model.model.norm.weight.data)
    h = head.hnorm.weight.numel()
    with torch.no_grad():
        head.eh_proj.weight.normal_(0.0, 0.02)
        head.eh_proj.weight[:, h:] += torch.eye(h)


def depth2_mask(n: int):
    """Mask over [depth-1 rows (n) ; depth-2 rows (n-1)]: depth-2 row j (position j+1) sees depth-1 keys
    0..j and itself; depth-1 rows are causal among themselves."""
    import torch

    total = 2 * n - 1
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    j = torch.arange(n - 1)
    mask[n:, :n] = torch.ones(n - 1, n, dtype=torch.bool).tril()
    mask[n + j, n + j] = True
    return mask[None, None]


def head_forward(head, model, x, mask2):
    """Depth-1 and depth-2 logits of the head for token windows x [B, L+2] (inputs x[:, :L])."""
    import torch

    B, L = x.shape[0], x.shape[1] - 2
    with torch.no_grad():
        out = model.model(input_ids=x[:, :L + 1])
        h = out.last_hidden_state
        target = model.lm_head(h).float()                                 # main distributions at 0..L
    embed = model.model.embed_tokens
    rotary = model.model.rotary_emb
    x1 = head.fuse(embed(x[:, 1:L + 1]), h[:, :L])
    pos1 = torch.arange(L).expand(B, L)
    y1 = head(x1, position_embeddings=rotary(x1, pos1))
    x2 = head.fuse(embed(x[:, 2:L + 1]), y1[:, :L - 1])
    pos = torch.cat([torch.arange(L), torch.arange(1, L)]).expand(B, 2 * L - 1)
    xx = torch.cat([x1, x2], dim=1)
    y2 = head(xx, attention_mask=mask2, position_embeddings=rotary(xx, pos))[:, L:]
    logits1 = model.lm_head(head.shared_head.norm(y1)).float()
    logits2 = model.lm_head(head.shared_head.norm(y2)).float()
    return logits1, logits2, target


def soft_ce(logits, target_logits):
    import torch.nn.functional as F

    p = F.softmax(target_logits, dim=-1)
    return -(p * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def evaluate(head, model, windows, mask2, batch: int, bf16: bool) -> dict:
    import torch
    import torch.nn.functional as F

    head.eval()
    agree1 = agree2 = n1 = n2 = 0
    nll = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(windows), batch):
            x = torch.stack(windows[i: i + batch])
            l1, l2, t = head_forward(head, model, x, mask2)
            main = t.argmax(-1)
            agree1 += (l1.argmax(-1) == main[:, 1:]).sum().item()
            agree2 += (l2.argmax(-1) == main[:, 2:]).sum().item()
            n1 += l1.shape[0] * l1.shape[1]
            n2 += l2.shape[0] * l2.shape[1]
            nll += F.cross_entropy(l1.reshape(-1, l1.size(-1)), x[:, 2:].reshape(-1), reduction="sum").item()
    head.train()
    return {"agree_depth1": agree1 / n1, "agree_depth2": agree2 / n2, "ppl_next_next": math.exp(nll / n1)}


def save_head(head, model_dir: Path, layer_idx: int) -> int:
    import torch
    from safetensors.torch import save_file

    tensors = {}
    for name, p in head.state_dict().items():
        keep_fp32 = name.startswith("mlp.gate.")          # the router, as in the main checkpoint
        tensors[f"model.layers.{layer_idx}.{name}"] = p.detach().to(
            torch.float32 if keep_fp32 else torch.bfloat16).contiguous()
    path = model_dir / MTP_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return path.stat().st_size


def schedule_step(args, step: int, elapsed: float, cpu: float) -> int:
    """Where the learning-rate schedule is: the step, or further along when a time budget will end the run
    first (the cosine then still decays to its end within the budget)."""
    fractions = [step / args.steps]
    if args.minutes:
        fractions.append(elapsed / (args.minutes * 60))
    if args.cpu_minutes:
        fractions.append(cpu / (args.cpu_minutes * 60))
    return max(step, min(args.steps, int(max(fractions) * args.steps)))


def train_loop(args, head, model, train_ids, val_windows, mask2) -> tuple[int, float, list]:
    import torch

    params = [p for p in head.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    balancer = RouterBalancer(head, rate=1e-3)
    gen = torch.Generator().manual_seed(args.seed)
    L = args.seq_len
    curve, ema, step = [], None, 0
    t_train, cpu0 = time.time(), time.process_time()
    for step in range(args.steps):
        lr = lr_at(schedule_step(args, step, time.time() - t_train, time.process_time() - cpu0), args.steps,
                   args.lr, args.warmup, 0.1)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_ids) - L - 2, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s: s + L + 2] for s in starts.tolist()]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            l1, l2, t = head_forward(head, model, x, mask2)
        loss1, loss2 = soft_ce(l1, t[:, 1:]), soft_ce(l2, t[:, 2:])
        loss = loss1 + args.depth2_weight * loss2
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balancer.step()
        ema = loss1.item() if ema is None else 0.95 * ema + 0.05 * loss1.item()
        elapsed = time.time() - t_train
        cpu = time.process_time() - cpu0
        last = (step == args.steps - 1 or (args.minutes and elapsed > args.minutes * 60)
                or (args.cpu_minutes and cpu > args.cpu_minutes * 60))
        if step % 25 == 0 or last:
            log(f"step {step:5d}/{args.steps}  depth-1 {loss1.item():.3f} (ema {ema:.3f})  depth-2 "
                f"{loss2.item():.3f}  lr {lr:.2e}  {elapsed / 60:.1f} min ({cpu / 60:.1f} CPU-min)")
        if (step + 1) % args.eval_every == 0 or last:
            ev = evaluate(head, model, val_windows, mask2, 8, args.bf16)
            curve.append((step + 1, ema, ev))
            log(f"  eval step {step + 1}: {ev}")
        if last:
            break
    return step + 1, time.time() - t_train, curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mla_runtime/demo_model", help="demo checkpoint folder (gets mtp.safetensors)")
    ap.add_argument("--steps", type=int, default=1600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-minutes", type=float, default=40.0,
                    help="CPU-time budget of the training loop (40 = 20 min on 2 busy cores); 0 = none")
    ap.add_argument("--minutes", type=float, default=0.0, help="wall-clock budget of the training loop; 0 = none")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast (fast only on CPUs with AVX-512 BF16; the default computes in fp32)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--depth2-weight", type=float, default=0.5)
    ap.add_argument("--max-corpus-mb", type=float, default=60.0)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-before", action="store_true", help="also score the initial head")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()
    model_dir = Path(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    train_docs, heldout_docs = build_corpus(args.max_corpus_mb)
    train_ids, held_ids = encode_docs(tok, train_docs), encode_docs(tok, heldout_docs)
    layer_idx = model.config.num_hidden_layers
    head = make_head(model.config, layer_idx)
    init_head(head, model)
    head.train()
    log(f"MTP head: {sum(p.numel() for p in head.parameters()):,} parameters (layer {layer_idx})")
    L = args.seq_len
    mask2 = depth2_mask(L)
    val_windows = eval_windows(held_ids, L + 1, args.eval_tokens // L)     # windows of L + 2 tokens
    before = evaluate(head, model, val_windows, mask2, 8, args.bf16) if args.eval_before else None
    log(f"before training: {before}")
    steps, train_s, curve = train_loop(args, head, model, train_ids, val_windows, mask2)
    final = evaluate(head, model, val_windows, mask2, 8, args.bf16)
    size = save_head(head, model_dir, layer_idx)
    log(f"held-out ({len(val_windows) * L:,} positions): {final}; saved {model_dir / MTP_FILE} ({size:,} bytes)")
    summary = {"steps": steps, "seed": args.seed, "threads": args.threads, "train_seconds": round(train_s, 1),
               "total_seconds": round(time.time() - t_start, 1), "bytes": size, "before": before,
               "final": final, "curve": curve, "torch": torch.__version__}
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
