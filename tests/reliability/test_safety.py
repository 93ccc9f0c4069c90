"""Nothing unsafe is loaded and nothing escapes: no pickle anywhere, no code from a checkpoint runs,
and output paths are resolved before the rules of featherweight/io/output_paths.py apply."""

import ast
import json
import pickle
import shutil
from pathlib import Path

import pytest

import featherweight
from featherweight.data.records import prepare_dataset
from featherweight.errors import DataError, OutputNotWritableError, UnsafeCheckpointError
from featherweight.io.loader import load_model
from featherweight.io.safetensors_reader import PICKLE_SUFFIXES
from featherweight.io.tokenizer import load_hf_tokenizer
from featherweight.train.export_run import export_run
from tests.reliability.catalogue_cases import TouchOnUnpickle

PACKAGE = Path(featherweight.__file__).parent
UNSAFE_MODULES = {"pickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}
UNSAFE_METHODS = {("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"),
                  ("yaml", "full_load"), ("importlib", "import_module")}  # fmt: skip


def _call_name(call: ast.Call) -> str | None:
    """`eval`, `torch.load`, ... when the call is one of the unsafe ones, else None."""
    function = call.func
    if isinstance(function, ast.Attribute):
        owner = getattr(function.value, "id", "")
        return f"{owner}.{function.attr}" if (owner, function.attr) in UNSAFE_METHODS else None
    name = getattr(function, "id", "")
    return name if name in UNSAFE_BUILTINS else None


def _unsafe_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [alias.name for alias in node.names]
            modules = names if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"import {m}" for m in modules if m.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.Call):
            if (name := _call_name(node)) is not None:
                found.append(f"{name}()")
            for keyword in node.keywords:
                if keyword.arg in ("allow_pickle", "trust_remote_code") and not (
                    isinstance(keyword.value, ast.Constant) and keyword.value.value is False
                ):
                    found.append(f"({keyword.arg}=...)")
    return found


def test_no_module_can_unpickle_or_run_loaded_code():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 30
    found = {
        str(path.relative_to(PACKAGE)): uses
        for path in modules
        if (uses := _unsafe_uses(ast.parse(path.read_text())))
    }
    # GRPO's reward functions are code the user names in the config to be run: the one place
    # that imports a module by name, and only the one the user gave (train/rewards.py)
    assert found == {"train/rewards.py": found.get("train/rewards.py", [])}
    assert set(found.get("train/rewards.py", [])) <= {"importlib.import_module()"}


def test_the_scan_sees_what_it_looks_for():
    source = "import pickle\nimport torch\nimport numpy as np\ntorch.load(f)\nnp.load(f, allow_pickle=True)\neval(x)\n"
    assert _unsafe_uses(ast.parse(source)) == [
        "import pickle", "torch.load()", "(allow_pickle=...)", "eval()"
    ]  # fmt: skip


@pytest.mark.parametrize("suffix", PICKLE_SUFFIXES)
def test_pickle_weights_are_refused_with_advice_and_never_opened(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    path.write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "PWNED")))
    with pytest.raises(
        UnsafeCheckpointError, match=r"never unpickles .* Convert it to safetensors"
    ):
        load_model(path)
    assert not (tmp_path / "PWNED").exists()


def test_safetensors_beside_a_pickle_are_loaded_and_the_pickle_never_touched(
    small_model_dir, tmp_path
):
    model_dir = Path(shutil.copytree(small_model_dir, tmp_path / "model"))
    (model_dir / "pytorch_model.bin").write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "PWNED")))
    assert load_model(model_dir).config.num_layers == 2
    assert not (tmp_path / "PWNED").exists()


def test_code_shipped_in_a_model_directory_never_runs(small_model_dir, tmp_path):
    model_dir = Path(shutil.copytree(small_model_dir, tmp_path / "model"))
    sentinel = tmp_path / "PWNED"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py"):
        (model_dir / name).write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    assert load_model(model_dir).tokenizer is not None
    assert not sentinel.exists()


def test_a_chat_template_cannot_escape_its_sandbox(tiny_model_dir, tmp_path):
    """A template is code from the checkpoint: it renders in jinja2's sandbox, and the classic
    escape (reaching `os` through a global's `__init__.__globals__`) is refused as a DataError."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", model_dir)
    sentinel = tmp_path / "PWNED"
    escape = f"{{{{ cycler.__init__.__globals__.os.system('touch {sentinel}') }}}}"
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": escape})
    )
    tokenizer = load_hf_tokenizer(model_dir)
    data = tmp_path / "chat.jsonl"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": conversation}) + "\n")
    with pytest.raises(DataError, match=r"chat\.jsonl:1: the chat template refused"):
        prepare_dataset(data, tokenizer, seq_len=64)
    assert not sentinel.exists()


# --- output paths are resolved first -----------------------------------------------------------


def test_an_export_inside_the_run_but_outside_its_checkpoints_is_allowed(trained_run, tmp_path):
    run = Path(shutil.copytree(trained_run, tmp_path / "run"))
    out = run / "checkpoints" / ".." / "adapter"
    assert export_run(run, "peft", out) == run / "adapter"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("how", ["dotdot", "symlink"])
def test_a_path_that_resolves_into_the_checkpoints_is_refused(trained_run, tmp_path, how):
    if how == "dotdot":
        out = trained_run / "merged" / ".." / "checkpoints" / "merged"
    else:
        (tmp_path / "link").symlink_to(trained_run / "checkpoints")
        out = tmp_path / "link" / "merged"
    with pytest.raises(OutputNotWritableError, match=rf"lies inside {trained_run}/checkpoints"):
        export_run(trained_run, "peft", out)
    assert not (trained_run / "checkpoints" / "merged").exists()


def test_a_whole_output_dir_may_be_a_link_elsewhere(tiny_model_dir, demo_data, tmp_path):
    """Rule 2 refuses links inside a run directory; linking the directory itself is the way."""
    from featherweight.recipe.schema import parse_config
    from featherweight.train.run import check_run_dir
    from tests.reliability.conftest import short_run

    (tmp_path / "big-disk").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a").symlink_to(tmp_path / "big-disk")
    config = parse_config(short_run(tiny_model_dir, demo_data, tmp_path / "runs" / "a"))
    assert check_run_dir(config, overwrite=False)[:2] == (tmp_path / "big-disk", False)
