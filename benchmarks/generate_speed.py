"""Tokens per second of greedy generation with the KV cache on SmolLM2-135M-Instruct (the demo GGUF).

Compilation is done by a first, untimed run of the same shapes; the timed runs report prefill
latency and decode throughput (new tokens after the first, per second). With --transformers, the
same greedy generation by transformers (PyTorch, reading the same GGUF) is timed in the same run
for the ratio. Writes its result lines to benchmarks/results/generate_speed_<platform>.txt with
the machine named.

    python benchmarks/generate_speed.py --machine "2-core CPU, no GPU" --transformers
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax

from featherweight.inference.generate import generate_ids
from featherweight.io.embedded_model import require_demo_model
from featherweight.io.loader import load_model

QUESTION = "Explain in a few sentences why the sky is blue."
RESULTS = Path(__file__).parent / "results"


def time_generation(generate, new_tokens: int) -> tuple[float, float]:
    """(seconds for the first token, seconds for the remaining new_tokens - 1) of greedy
    `generate(n)`, which returns the n new token ids."""
    start = time.perf_counter()
    generate(1)
    first = time.perf_counter() - start
    start = time.perf_counter()
    tokens = generate(new_tokens)
    total = time.perf_counter() - start
    assert len(tokens) == new_tokens
    return first, total - first


def measure(generate, new_tokens: int, repeats: int) -> tuple[float, float]:
    """(prefill + first token seconds, decode tokens/s), each the best of `repeats` runs (the
    least disturbed by other work on the machine), after an untimed warm-up of both shapes."""
    for count in (1, new_tokens):
        generate(count)
    runs = [time_generation(generate, new_tokens) for _ in range(repeats)]
    prefill = min(first for first, _ in runs)
    rate = max((new_tokens - 1) / rest for _, rest in runs)
    return prefill, rate


def transformers_generator(gguf: Path, prompt: list[int]):
    """Greedy generation by transformers reading the same GGUF (float32, no end-of-text stop)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    input_ids = torch.tensor([prompt])

    def generate(count: int) -> list[int]:
        with torch.no_grad():
            output = model.generate(
                input_ids, max_new_tokens=count, min_new_tokens=count, do_sample=False
            )
        return output[0, len(prompt) :].tolist()

    return generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="2-core CPU, no GPU", help="named in the result")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transformers", action="store_true", help="also time transformers")
    args = parser.parse_args()

    gguf = require_demo_model()
    model = load_model(gguf, dtype=args.dtype)
    tokenizer = model.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    prefill, rate = measure(
        lambda count: generate_ids(model, prompt, max_new_tokens=count),
        args.new_tokens,
        args.repeats,
    )
    platform = jax.devices()[0].platform
    line = (
        f"generate_speed: SmolLM2-135M-Instruct (Q4_1 GGUF -> {args.dtype}), KV cache, greedy, "
        f"prompt {len(prompt)} tokens, {args.new_tokens} new tokens: "
        f"decode {rate:.1f} tokens/s, prefill + first token {prefill * 1000:.0f} ms "
        f"(best of {args.repeats}; jax {jax.__version__} on {platform}; {args.machine}; "
        f"1-minute load average {os.getloadavg()[0]:.1f})"
    )
    if args.transformers:
        hf_prefill, hf_rate = measure(
            transformers_generator(gguf, prompt), args.new_tokens, args.repeats
        )
        line += (
            f"\ngenerate_speed: transformers on the same GGUF (float32, PyTorch CPU), same run: "
            f"decode {hf_rate:.1f} tokens/s, prefill + first token {hf_prefill * 1000:.0f} ms; "
            f"featherweight / transformers decode = {rate / hf_rate:.2f}"
        )
    print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"generate_speed_{platform}.txt").write_text(line + "\n")


if __name__ == "__main__":
    main()
