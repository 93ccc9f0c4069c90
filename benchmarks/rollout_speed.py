"""GRPO rollout throughput: a group of sampled completions per prompt by featherweight's rollout
sampler (`inference/rollout.py`: one prefill, the group decoded together in one while_loop) and by
transformers' `generate` (`num_return_sequences`, sampling), on SmolLM2-135M-Instruct (the demo
GGUF, float32), the same prompt, group size and length, in one run for the ratio.

Every completion runs to the length limit (no stop token), so both make exactly
generations x new tokens; compilation and warm-up are a first, untimed run of the same shapes;
each side reports the best of `--repeats` (the run least disturbed by other work on the machine).
Writes its result line to benchmarks/results/rollout_speed_<platform>.txt with the machine named.

    python benchmarks/rollout_speed.py --machine "2-core CPU, no GPU"
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import jax

from featherweight.inference.rollout import Sampling, sample_rollouts
from featherweight.io.embedded_model import require_demo_model
from featherweight.io.loader import load_model

QUESTION = "What colour is the planet Velquador?"
RESULTS = Path(__file__).parent / "results"


def best_rate(sample, tokens: int, repeats: int) -> float:
    """Completion tokens per second of `sample()`, the best of `repeats` after one warm-up."""
    sample()
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        sample()
        rates.append(tokens / (time.perf_counter() - start))
    return max(rates)


def transformers_sampler(gguf: Path, prompt: list[int], generations: int, new_tokens: int):
    """transformers sampling `generations` completions of `new_tokens` from the same GGUF."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    input_ids = torch.tensor([prompt])

    def sample():
        with torch.no_grad():
            output = model.generate(
                input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=generations,
            )  # fmt: skip
        assert output.shape == (generations, len(prompt) + new_tokens)

    return sample


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default="2-core CPU, no GPU", help="named in the result")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    gguf = require_demo_model()
    model = load_model(gguf, dtype="float32")
    tokenizer = model.tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    prompt = tokenizer.encode(text, add_special_tokens=False)
    sampling = Sampling(1.0, 1.0, args.new_tokens)
    tokens = args.generations * args.new_tokens
    calls = iter(range(1 << 30))

    def ours():
        rollout = sample_rollouts(
            model.params, model.config, model.lora, [prompt], jax.random.PRNGKey(next(calls)),
            args.generations, sampling, (), model.dtype,
        )  # fmt: skip
        assert rollout.lengths.sum() == tokens

    rate = best_rate(ours, tokens, args.repeats)
    theirs = best_rate(
        transformers_sampler(gguf, prompt, args.generations, args.new_tokens), tokens, args.repeats
    )
    platform = jax.devices()[0].platform
    line = (
        f"rollout_speed: SmolLM2-135M-Instruct (Q4_1 GGUF -> float32), {args.generations} "
        f"sampled completions of {args.new_tokens} tokens after a {len(prompt)}-token prompt, "
        f"measured in one run: featherweight rollouts {rate:.1f} completion tokens/s, "
        f"transformers generate {theirs:.1f} tokens/s; featherweight / transformers = "
        f"{rate / theirs:.2f} (best of {args.repeats}; jax {jax.__version__} on {platform}; "
        f"{args.machine}; 1-minute load average {os.getloadavg()[0]:.1f})"
    )
    print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"rollout_speed_{platform}.txt").write_text(line + "\n")


if __name__ == "__main__":
    main()
