"""Models by their Hugging Face Hub name, resolved from a local Hub cache laid out as
huggingface_hub lays it out (this machine has no Hub): HF_HUB_OFFLINE, HF_HUB_CACHE and HF_HOME
honoured when asked, a local path wins over a name, gated / missing / uncached models refused in
one line that says what to do."""

import json
import shutil

import huggingface_hub
import pytest
import yaml
from huggingface_hub import errors as hub_errors
from typer.testing import CliRunner

from featherweight.cli.main import app
from featherweight.errors import HubModelError
from featherweight.io.hub import is_hub_name, model_location
from featherweight.io.loader import open_checkpoint
from featherweight.io.model_source import model_config_from
from tests.conftest import run_settings, write_config
from tests.hub_cache import add_to_hub_cache, hub_refusal


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_model_dir):
    cache = tmp_path / "hub"
    snapshot = add_to_hub_cache(cache, "tiny-org/tiny-model", tiny_model_dir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return snapshot


def test_a_hub_name_resolves_to_its_snapshot_in_the_cache_offline(offline_cache, tiny_model_dir):
    assert model_location("tiny-org/tiny-model") == offline_cache
    source = open_checkpoint(model_location("tiny-org/tiny-model"))
    assert source.config == open_checkpoint(tiny_model_dir).config
    assert model_config_from("tiny-org/tiny-model") == source.config
    source.close()


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_model_dir):
    snapshot = add_to_hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-model", tiny_model_dir)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_location("tiny-org/tiny-model") == snapshot


def test_a_path_of_that_name_wins_over_the_hub(offline_cache, tmp_path, monkeypatch):
    (tmp_path / "tiny-org" / "tiny-model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_name("tiny-org/tiny-model")
    assert model_location("tiny-org/tiny-model").resolve() == tmp_path / "tiny-org" / "tiny-model"


def test_a_model_not_in_the_cache_while_offline_says_what_to_do(offline_cache):
    with pytest.raises(HubModelError) as error:
        model_location("tiny-org/other-model")
    message = str(error.value)
    assert (
        "model tiny-org/other-model is neither a path on this machine nor in the local Hub"
        in message
    )
    assert "HF_HUB_OFFLINE is set; unset HF_HUB_OFFLINE to download it" in message


GATED = (
    "is gated on the Hugging Face Hub: accept its license at https://huggingface.co/org/name, "
    "log in (hf auth login, or set HF_TOKEN)"
)
MISSING = "'org/name' is neither a path on this machine nor a model on the Hugging Face Hub"


@pytest.mark.parametrize(
    ("error", "status", "says"),
    [(hub_errors.GatedRepoError, 403, GATED), (hub_errors.RepositoryNotFoundError, 404, MISSING)],
)
def test_gated_and_missing_repositories_are_named_with_the_fix(monkeypatch, error, status, says):
    def refuse(*_args, **_kwargs):
        raise hub_refusal(error, status, "org/name")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(HubModelError) as raised:
        model_location("org/name")
    assert says in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.slow
def test_every_command_takes_a_hub_name_from_the_cache_offline(
    offline_cache, tiny_model_dir, demo_data, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    settings = run_settings("tiny-org/tiny-model", demo_data, "run", steps=2)
    write_config(tmp_path / "config.yaml", settings)
    cli = lambda *args: CliRunner().invoke(app, [str(arg) for arg in args])

    trained = cli("train", "config.yaml")
    assert trained.exit_code == 0, trained.output
    run = tmp_path / "run"
    assert (
        yaml.safe_load((run / "config.yaml").read_text())["model"]["path"] == "tiny-org/tiny-model"
    )
    assert json.loads((run / "run.json").read_text())["model_revision"] == offline_cache.name
    # main moves on to a new commit with another config: the run keeps the commit it trained on
    changed = tmp_path / "changed"
    shutil.copytree(tiny_model_dir, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    add_to_hub_cache(offline_cache.parents[2], "tiny-org/tiny-model", changed, "b" * 40)
    resumed = cli("train", "config.yaml", "--set", "steps=3")
    assert resumed.exit_code == 0 and "resuming" in resumed.output, resumed.output

    assert cli("generate", run, "--max-new-tokens", "2").exit_code == 0
    assert cli("generate", "tiny-org/tiny-model", "--max-new-tokens", "2").exit_code == 0
    assert (
        cli(
            "plan", "tiny-org/tiny-model", "--method", "lora", "--seq", "64", "--no-measure"
        ).exit_code
        == 0
    )
    assert cli("convert", "tiny-org/tiny-model", "--out", "converted").exit_code == 0
    assert (tmp_path / "converted" / "model.safetensors").is_file()

    assert cli("export", run, "--format", "peft", "--out", "adapter").exit_code == 0
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny-org/tiny-model"  # what peft loads
    named = cli(
        "export", run, "--format", "peft", "--out", "a2", "--base-model", "tiny-org/tiny-model"
    )
    assert named.exit_code == 0, named.output
    missing = cli("export", run, "--format", "peft", "--out", "a3", "--base-model", "tiny-org/nope")
    assert (
        missing.exit_code == 2 and "HubModelError: model tiny-org/nope is neither" in missing.output
    )
    assert not (tmp_path / "a3").exists()
