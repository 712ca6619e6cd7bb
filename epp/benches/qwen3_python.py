#!/usr/bin/env python3
"""Python `tokenizers` (what vLLM calls) on the kv_events bench's kind of
text, for scale beside `cargo bench -p kinference-epp --bench kv_events`.

    PY=~/.cache/kinference/peers/inference-perf-0.7.0/venv/bin/python
    $PY epp/benches/qwen3_python.py "$(bash bench/peers/install.sh qwen3-tokenizer | tail -n1)/qwen3-tokenizer"

Random words of 2-9 letters (a new text each time: the tokenizer's word
cache rarely hits), mean of 5 encodes each.
"""
import random
import sys
import time

import tokenizers

tok = tokenizers.Tokenizer.from_file(f"{sys.argv[1]}/tokenizer.json")
rng = random.Random(7)


def words(n: int) -> str:
    out, size = [], 0
    while size < n:
        w = "".join(chr(rng.randint(97, 122)) for _ in range(rng.randint(2, 9)))
        w += ". " if rng.random() < 1 / 12 else " "
        out.append(w)
        size += len(w)
    return "".join(out)


for name, size in [("7KB", 7 * 1024), ("220KB", 220 * 1024)]:
    total = 0.0
    for _ in range(5):
        text = words(size)
        start = time.perf_counter()
        tok.encode(text, add_special_tokens=False)
        total += time.perf_counter() - start
    print(f"python tokenizers {tokenizers.__version__}, new text/{name}: {total / 5 * 1000:.2f} ms")
