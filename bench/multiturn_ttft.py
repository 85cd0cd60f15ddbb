"""Multi-turn prefix reuse: TTFT of a chat's second turn against its first, on the demo model.

    python bench/multiturn_ttft.py

Turn 1 is a user message holding the first 6,000 characters of the stdlib's shutil.py; turn 2 repeats the chat
with the reply and a short follow-up, so all its full blocks but the tail come from the prefix cache.
"""

import pathlib
import sysconfig

from mla_runtime import LLM, SamplingParams
from mla_runtime.tokenizer import apply_chat_template

if __name__ != "__main__":
    raise SystemExit("run as a script")
llm = LLM("mla_runtime/demo_model", kv_cache_memory="256MiB")
tok = llm.tokenizer
src = (pathlib.Path(sysconfig.get_paths()["stdlib"]) / "shutil.py").read_text()[:6000]
turn1 = [{"role": "user", "content": src}]
ids1 = apply_chat_template(tok, turn1)
p = SamplingParams(max_tokens=16, temperature=0)
o1 = llm.generate([{"prompt_token_ids": ids1}], p)[0]
turn2 = turn1 + [{"role": "assistant", "content": o1.outputs[0].text}, {"role": "user", "content": "and then?"}]
ids2 = apply_chat_template(tok, turn2)
o2 = llm.generate([{"prompt_token_ids": ids2}], p)[0]
print(f"turn 1: {len(ids1)} prompt tokens, cached {o1.num_cached_tokens}, TTFT {o1.metrics.ttft*1000:.0f} ms")
print(f"turn 2: {len(ids2)} prompt tokens, cached {o2.num_cached_tokens}, TTFT {o2.metrics.ttft*1000:.0f} ms")
