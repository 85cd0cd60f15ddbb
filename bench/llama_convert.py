"""Convert the benchmark checkpoint to GGUF with llama.cpp's own converter (run by its environment's python).

    bench/llama.cpp/venv/bin/python bench/llama_convert.py bench/out/peer_ckpt --outtype q8_0 --outfile X.gguf

``bench/peer_checkpoint.py`` builds weights only: it has no tokenizer, which the converter reads for the
vocabulary. The benchmark feeds token ids and never text, so this runs ``convert_hf_to_gguf.py`` unchanged
except for the vocabulary: ``vocab_size`` placeholder tokens (a GPT-2 style vocabulary with no merges, bos 0,
eos 1) in place of one read from a tokenizer. Every tensor goes through the converter's own DeepSeek-V2/V3
path (``kv_b_proj`` split into ``attn_k_b``/``attn_v_b`` for the MLA path; ``--outtype`` f32, bf16 or q8_0).
``LLAMA_CPP_SRC`` (default ``bench/llama.cpp/src``) is the tree ``bench/setup_peers.sh`` unpacked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SRC = Path(os.environ.get("LLAMA_CPP_SRC", Path(__file__).resolve().parent / "llama.cpp" / "src"))


def placeholder_vocab(self) -> None:
    import gguf

    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)
    self.gguf_writer.add_token_merges(["< t"])
    self.gguf_writer.add_bos_token_id(self.hparams.get("bos_token_id", 0))
    self.gguf_writer.add_eos_token_id(self.hparams.get("eos_token_id", 1))


def main() -> None:
    sys.path.insert(0, str(SRC))
    import convert_hf_to_gguf
    from conversion.deepseek import DeepseekV2Model

    DeepseekV2Model.set_vocab = placeholder_vocab
    sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
