"""The model commands as a user types them: `demo` names the embedded model in `generate`, `chat`
and `convert` as it does in a config (before, "model path demo does not exist"); text that is not
UTF-8 (bytes a shell passes through) is refused in one line, or skipped in a chat that goes on,
where it used to end both with "bug: TypeError: TextInputSequence must be str". `generate` puts
the reply alone on stdout (scripts read it), the rest on stderr; `featherweight --version`."""

from importlib.metadata import version
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import ConfigError
from featherweight.inference import generate as generate_module
from featherweight.io import convert, loader
from featherweight.train import run_model


@pytest.fixture
def loaded_paths(monkeypatch):
    """The paths the commands load a model from; no weight is read (the load stops at once)."""
    paths = []

    def load_model(path, **_):
        paths.append(path)
        raise ConfigError("stopped by the test")

    monkeypatch.setattr(loader, "load_model", load_model)
    return paths


def test_demo_names_the_embedded_model_in_generate_chat_and_convert(
    demo_gguf, loaded_paths, tmp_path, monkeypatch
):
    for argv in (["generate", "demo"], ["chat", "demo"], ["generate"]):
        assert CliRunner().invoke(app, argv).exit_code == 2
    assert loaded_paths == [demo_gguf] * 3
    sources = []
    monkeypatch.setattr(convert, "convert", lambda source, out, **_: sources.append(source) or out)
    converted = CliRunner().invoke(app, ["convert", "demo", "--out", str(tmp_path / "hf")])
    assert converted.exit_code == 0, converted.output
    assert sources == [demo_gguf]


def test_a_path_named_demo_is_that_path(loaded_paths, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    CliRunner().invoke(app, ["generate", "demo"])
    assert loaded_paths == ["demo"]


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(loaded_paths):
    result = CliRunner().invoke(app, ["generate", "demo", "--prompt", "caf\udce9 au lait"])
    assert result.exit_code == 2
    assert "byte 0xe9 at character 4 is not UTF-8 text" in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "bug" not in result.stderr
    assert not loaded_paths  # refused before any model is read


def test_a_chat_line_that_is_not_utf8_is_skipped_and_the_session_goes_on(monkeypatch):
    model = SimpleNamespace(source="a model")
    monkeypatch.setattr(loader, "load_model", lambda path, **_: model)
    echo = lambda _model, messages, *_: (f"you said {message}" for message in messages)
    monkeypatch.setattr(run_model, "chat_replies", echo)
    result = CliRunner().invoke(app, ["chat", "demo"], input=b"caf\xe9\nhello\n/exit\n")
    assert result.exit_code == 0, result.output
    assert "skipped that line: byte 0xe9 at character 4 is not UTF-8 text" in result.stderr
    assert "model> you said hello" in result.output  # the next line was answered


def test_generate_prints_the_reply_alone_on_stdout(monkeypatch):
    model = SimpleNamespace(source="a model", config=SimpleNamespace(num_layers=2))
    model.dtype = SimpleNamespace(name="float32")
    monkeypatch.setattr(loader, "load_model", lambda path, **_: model)
    monkeypatch.setattr(generate_module, "generate", lambda *_: "The planet is blue.")
    result = CliRunner().invoke(app, ["generate", "demo", "--prompt", "Which colour?"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "The planet is blue.\n"
    assert "model: a model" in result.stderr


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout == f"featherweight {version('featherweight')}\n"
