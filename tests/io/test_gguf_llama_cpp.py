"""llama.cpp runs what featherweight exports: the merged GGUF gives featherweight's logits and
greedy tokens, and the adapter GGUF on the base GGUF (`llama-server --lora`) gives the merged
model's greedy tokens. Needs `llama-cpp-python` (built from source; not a dependency): skipped
when it is not installed."""

import json

import numpy as np
import pytest

from featherweight.inference.generate import generate_ids, logits
from featherweight.io.convert import convert
from featherweight.io.loader import load_model
from featherweight.io.ollama import ADAPTER_FILE, MODEL_FILE, MODELFILE
from featherweight.recipe.schema import parse_config
from featherweight.train.export_run import export_run
from featherweight.train.loop import train
from featherweight.train.saved_run import read_run_config
from tests.conftest import run_settings
from tests.io.test_gguf_kquants import KQUANT_SIZES, q4_k_m
from tests.reliability.conftest import trained_run
from tests.tiny_checkpoints import hf_config, random_hf_model, write_gguf

__all__ = ["trained_run"]  # the shared 4-step LoRA run (q and v adapters, rank 4)

llama_cpp = pytest.importorskip("llama_cpp")
NEW_TOKENS = 16


def prompt_of(model) -> list[int]:
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    return model.tokenizer.encode(text, add_special_tokens=False)


def llama_cpp_greedy(llm, prompt: list[int]) -> list[int]:
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if len(tokens) == NEW_TOKENS:
            break
    return tokens


@pytest.mark.slow
def test_llama_cpp_runs_the_merged_gguf_as_featherweight_does(trained_run, tmp_path):
    out = export_run(trained_run, "gguf", tmp_path / "gguf", quant="f32")
    ours = load_model(out / MODEL_FILE)
    prompt = prompt_of(ours)
    llm = llama_cpp.Llama(
        model_path=str(out / MODEL_FILE), n_ctx=128, logits_all=True, verbose=False, n_threads=1
    )
    llm.eval(prompt)
    theirs = np.asarray(llm.scores[: len(prompt)])
    expected = np.asarray(logits(ours, np.asarray([prompt])))[0]
    print(f"llama.cpp vs featherweight logits: max abs diff {np.abs(theirs - expected).max():.2e}")
    assert np.abs(theirs - expected).max() <= 1e-3 * np.abs(expected).max()
    assert llama_cpp_greedy(llm, prompt) == generate_ids(ours, prompt, max_new_tokens=NEW_TOKENS)


@pytest.mark.slow
def test_llama_cpp_applies_the_adapter_gguf(trained_run, tmp_path):
    base = convert(
        read_run_config(trained_run).model.path, tmp_path / "base", to="gguf", quant="f32"
    )
    adapter = export_run(trained_run, "gguf-adapter", tmp_path / "adapter")
    merged = load_model(
        export_run(trained_run, "gguf", tmp_path / "merged", quant="f32") / MODEL_FILE
    )
    prompt = prompt_of(merged)
    llm = llama_cpp.Llama(
        model_path=str(base / MODEL_FILE),
        lora_path=str(adapter / ADAPTER_FILE),
        n_ctx=128,
        verbose=False,
        n_threads=1,
    )
    expected = generate_ids(merged, prompt, max_new_tokens=NEW_TOKENS)
    assert llama_cpp_greedy(llm, prompt) == expected
    plain = generate_ids(load_model(base / MODEL_FILE), prompt, max_new_tokens=NEW_TOKENS)
    assert plain != expected  # the adapter changes what the model says


@pytest.mark.slow
def test_qlora_from_a_q4_k_m_file_exports_what_llama_cpp_runs(tmp_path):
    """The whole path a user takes: a Q4_K_M file, QLoRA on it, `export --format gguf` (+ the
    Ollama Modelfile), and llama.cpp generating from the export as featherweight does."""
    source = write_gguf(
        tmp_path / "model.gguf",
        random_hf_model(hf_config("llama2", **KQUANT_SIZES, vocab_size=256 + 64)),
        type_of=q4_k_m,
    )
    data = tmp_path / "train.jsonl"
    lines = [json.dumps({"text": f"item {i}: the cat sat on the mat. " * 3}) for i in range(16)]
    data.write_text("\n".join(lines) + "\n")
    settings = run_settings(source, data, tmp_path / "run", method="qlora", steps=2)
    settings["data"]["eval_fraction"] = 0.0
    run = train(parse_config(settings)).output_dir
    out = export_run(run, "gguf", tmp_path / "gguf", quant="f32")
    assert (out / MODELFILE).is_file()
    ours = load_model(out / MODEL_FILE)
    prompt = ours.tokenizer.encode("the cat sat", add_special_tokens=False)
    llm = llama_cpp.Llama(model_path=str(out / MODEL_FILE), n_ctx=64, verbose=False, n_threads=1)
    assert llama_cpp_greedy(llm, prompt) == generate_ids(ours, prompt, max_new_tokens=NEW_TOKENS)
