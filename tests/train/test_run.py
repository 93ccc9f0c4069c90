"""A run directory refuses another run's config, naming each changed setting with its old and
new value."""

import pytest
import yaml

from featherweight.errors import OutputExistsError
from featherweight.recipe.schema import changed_settings, parse_config
from featherweight.train.run import check_run_dir


def test_a_refused_resume_names_the_changed_keys_with_old_and_new_values(tmp_path):
    first = parse_config({"output_dir": str(tmp_path), "optimizer": {"learning_rate": 2e-4}})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(first.model_dump(mode="json")))
    changed = parse_config(
        {"output_dir": str(tmp_path), "optimizer": {"learning_rate": 1e-3}, "lora": {"rank": 4}}
    )
    with pytest.raises(
        OutputExistsError,
        match=r"its config differs: lora\.rank: 8 -> 4; optimizer\.learning_rate: 0\.0002 -> 0\.001\)",
    ):
        check_run_dir(changed, overwrite=False)
    more_steps = parse_config({"output_dir": str(tmp_path), "steps": 500})
    assert check_run_dir(more_steps, overwrite=False) == (tmp_path.resolve(), True)


def test_changed_settings_are_bounded():
    old = {f"key{n}": n for n in range(9)}
    new = {f"key{n}": n + 1 for n in range(9)}
    assert changed_settings(old, new).endswith("key4: 4 -> 5; and 4 more")
