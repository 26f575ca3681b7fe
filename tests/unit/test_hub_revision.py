"""A run reads one Hub revision for its whole life (aiayn/data/hub_revision.py): the commit the
Hub served at the first start, recorded in the run, or the one data.hub_revision names."""

import dataclasses
import json
import types

import pytest

from aiayn.config import Config, DataConfig
from aiayn.data import open_split
from aiayn.data.hub_revision import RECORD, pin_hub_revision


def config(tmp_path, **data) -> Config:
    data = DataConfig(format="hub", hub_name="wmt/wmt14", hub_config="de-en", **data)
    return dataclasses.replace(Config(), run_dir=str(tmp_path / "run"), data=data)


@pytest.fixture
def hub(monkeypatch):
    """What the Hub serves now (None: it cannot be reached), and load_dataset's calls."""
    import datasets
    import huggingface_hub

    state = types.SimpleNamespace(sha="c0ffee", calls=[])

    class Api:
        def dataset_info(self, name):
            if state.sha is None:
                raise ConnectionError("offline")
            return types.SimpleNamespace(sha=state.sha)

    def load_dataset(*args, **kwargs):
        state.calls.append(kwargs)
        rows = [{"translation": {"de": "eins", "en": "one"}}]
        return datasets.IterableDataset.from_generator(lambda: iter(rows))

    monkeypatch.setattr(huggingface_hub, "HfApi", Api)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return state


def test_the_first_start_pins_the_served_commit_and_restarts_keep_it(tmp_path, hub):
    pinned = pin_hub_revision(config(tmp_path))
    assert pinned.data.hub_revision == "c0ffee"
    assert json.loads((tmp_path / "run" / RECORD).read_text())["revision"] == "c0ffee"
    list(open_split(pinned.data, "train", "seq2seq"))
    assert hub.calls[-1]["revision"] == "c0ffee"
    hub.sha = "beef"  # the dataset moved on; the run does not
    assert pin_hub_revision(config(tmp_path)).data.hub_revision == "c0ffee"
    hub.sha = None  # nor does a restart need the Hub to know it
    assert pin_hub_revision(config(tmp_path)).data.hub_revision == "c0ffee"


def test_a_revision_in_the_config_is_used_and_recorded(tmp_path, hub):
    assert pin_hub_revision(config(tmp_path, hub_revision="v1.0")).data.hub_revision == "v1.0"
    assert pin_hub_revision(config(tmp_path)).data.hub_revision == "v1.0"


def test_an_offline_first_start_runs_unpinned_and_says_so(tmp_path, hub, caplog):
    hub.sha = None
    assert pin_hub_revision(config(tmp_path)).data.hub_revision is None
    assert "set data.hub_revision to pin it" in caplog.text
    assert not (tmp_path / "run" / RECORD).exists()
    list(open_split(config(tmp_path).data, "train", "seq2seq"))
    assert "revision" not in hub.calls[-1]


def test_local_files_and_folders_have_no_revision(tmp_path, hub):
    local = dataclasses.replace(config(tmp_path), data=DataConfig(format="parallel"))
    assert pin_hub_revision(local) is local
    folder = config(tmp_path)
    folder = dataclasses.replace(
        folder, data=dataclasses.replace(folder.data, hub_name=str(tmp_path))
    )
    assert pin_hub_revision(folder) is folder
