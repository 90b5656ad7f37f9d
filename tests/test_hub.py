"""Models from the Hugging Face Hub, offline: a Hub-layout cache built here (`models--org--name/{refs,
snapshots,blobs}`, as huggingface_hub writes it) holding tiny Llama checkpoints at two revisions.
`org/name` and its revisions resolve to their snapshots, through the API and the command line; the
tokenizer and chat template come from the checkpoint; what cannot resolve fails with a HubModelError
that says what to do. Downloads are tested against a stand-in Hub on 127.0.0.1 (tests/fake_hub.py,
HF_ENDPOINT). HF_HUB_OFFLINE=1 in every test but those, which name that endpoint: nothing here
reaches the Hub."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from depthserve import LLM, SamplingParams
from depthserve.errors import ConfigurationError, HubModelError, UnknownModelError
from depthserve.loading.hub import hub_snapshot, is_hub_id
from depthserve.loading.registry import resolve_model
from depthserve.loading.tokenizer import byte_tokenizer
from depthserve.lab.make_tiny import make_tiny
from depthserve.tools.cli import main as cli_main
from tests.fake_hub import FakeHub, checkpoint_files, serve_fake_hub

REPO = "tiny-org/tiny-llama"
CHAT_TEMPLATE = ("{% for m in messages %}<<{{ m['role'] | upper }}::{{ m['content'] }}>>{% endfor %}"
                 "{% if add_generation_prompt %}<<ASSISTANT::{% endif %}")
PROMPT = [5, 17, 33, 2, 90, 41, 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def publish(cache: Path, repo_id: str, checkpoint: Path, ref: str) -> Path:
    """Put `checkpoint`'s files into the Hub cache `cache` as huggingface_hub does: each file a blob
    named by its hash, the snapshot of a commit a folder of links to the blobs, `refs/<ref>` that
    commit. Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{ref}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(checkpoint.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def tiny_checkpoint(out: Path, seed: int) -> Path:
    """A tiny random Llama whose chat template lives in tokenizer_config.json (and nowhere else)."""
    path = make_tiny("llama", out, seed=seed, tokenizer=byte_tokenizer())
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The cache: REPO at main (seed 1) and at branch v2 (seed 2); a repository without weights and
    one without config.json."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hub-cache"
    main = publish(cache, REPO, tiny_checkpoint(root / "main", seed=1), "main")
    v2 = publish(cache, REPO, tiny_checkpoint(root / "v2", seed=2), "v2")
    no_weights = root / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    publish(cache, "tiny-org/no-weights", no_weights, "main")
    gguf_only = root / "gguf-only"
    gguf_only.mkdir()
    (gguf_only / "model-Q4_0.gguf").write_bytes(b"GGUF")
    publish(cache, "tiny-org/no-config", gguf_only, "main")
    return SimpleNamespace(root=root, cache=cache, main=main, v2=v2)


@pytest.fixture(autouse=True)
def offline_hub(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub.cache))
    monkeypatch.delenv("HF_HOME", raising=False)


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(model, device="cpu", dtype="float32", load_progress=False, max_model_len=64, block_size=8,
               kv_cache_memory_gib=0.01, **kwargs)


def greedy_tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def direct_tokens(hub) -> dict[str, list[int]]:
    """What each snapshot generates when loaded from its directory, by ref."""
    return {ref: greedy_tokens(tiny_llm(str(path))) for ref, path in (("main", hub.main), ("v2", hub.v2))}


def test_hub_id_loads_its_snapshot_and_generates_what_the_directory_generates(hub, direct_tokens):
    assert direct_tokens["main"] != direct_tokens["v2"]  # the two revisions are told apart by their tokens
    assert resolve_model(REPO).path == hub.main
    llm = tiny_llm(REPO)
    assert llm.engine.model_name == REPO  # the served name stays the Hub id
    assert greedy_tokens(llm) == direct_tokens["main"]


def test_revision_picks_the_snapshot_its_branch_or_commit_names(hub, direct_tokens):
    assert resolve_model(REPO, revision="v2").path == hub.v2
    assert resolve_model(REPO, revision=hub.v2.name).path == hub.v2  # a commit hash
    assert resolve_model(REPO, revision="main").path == hub.main
    assert greedy_tokens(tiny_llm(REPO, revision="v2")) == direct_tokens["v2"]


def test_hf_home_names_the_cache_when_hf_hub_cache_is_unset(hub, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(HubModelError, match="is not in the Hugging Face cache"):
        resolve_model(REPO)
    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "hub").symlink_to(hub.cache)
    assert resolve_model(REPO).path.resolve() == hub.main.resolve()


def test_chat_template_comes_from_the_checkpoints_tokenizer_config(hub):
    assert not (hub.main / "chat_template.jinja").exists()
    assert json.loads((hub.main / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    llm = tiny_llm(REPO)
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    ids = llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids) == "<<USER::hi>><<ASSISTANT::"


def test_an_id_not_in_the_cache_offline_says_how_to_download_it():
    with pytest.raises(HubModelError) as missing:
        LLM("tiny-org/not-cached")
    message = str(missing.value)
    assert "'tiny-org/not-cached' is not in the Hugging Face cache" in message
    assert "HF_HUB_OFFLINE=1" in message and "`hf download tiny-org/not-cached`" in message
    assert isinstance(missing.value, UnknownModelError)  # caught wherever an unknown model is
    with pytest.raises(HubModelError, match="at revision 'nosuch' is not in the Hugging Face cache.*"
                                            "`hf download tiny-org/tiny-llama --revision nosuch`"):
        resolve_model(REPO, revision="nosuch")


@pytest.mark.parametrize("repo, words", [
    ("tiny-org/no-weights", "has no \\*.safetensors weights"),
    ("tiny-org/no-config", "has no config.json"),
])
def test_a_cached_repository_that_is_no_checkpoint_is_refused(repo, words):
    with pytest.raises(HubModelError, match=words):
        resolve_model(repo)


def _hub_error(kind: type[Exception], status: int) -> Exception:
    """One of huggingface_hub's HTTP errors as its client raises it (built without an HTTP client:
    its constructor's response type depends on huggingface_hub's version)."""
    error = kind.__new__(kind)
    OSError.__init__(error, f"{status} from the Hub")
    error.response = SimpleNamespace(status_code=status)
    return error


@pytest.mark.parametrize("kind, status, words, names_the_token", [
    (GatedRepoError, 403, "'tiny-org/x' is a gated model: accept its terms on https://huggingface.co/tiny-org/x "
                          "and set HF_TOKEN", True),
    (RepositoryNotFoundError, 401, "no model 'tiny-org/x' on the Hugging Face Hub (or it is private: set HF_TOKEN",
     True),
    (RevisionNotFoundError, 404, "'tiny-org/x' on the Hugging Face Hub has no revision 'v9'", False),
    (HfHubHTTPError, 403, "refused 'tiny-org/x' at revision 'v9' (HTTP 403): set HF_TOKEN", True),
    (HfHubHTTPError, 503, "refused 'tiny-org/x' at revision 'v9' (HTTP 503)", False),
])
def test_hub_answers_become_errors_that_say_what_to_do(monkeypatch, kind, status, words, names_the_token):
    def refuse(*args, **kwargs):
        raise _hub_error(kind, status)

    monkeypatch.setattr("huggingface_hub.snapshot_download", refuse)
    with pytest.raises(HubModelError) as refused:
        hub_snapshot("tiny-org/x", revision="v9")
    assert words in str(refused.value)
    assert ("HF_TOKEN" in str(refused.value)) is names_the_token


def test_revision_applies_to_hub_ids_only(hub):
    with pytest.raises(ConfigurationError, match="applies to Hugging Face Hub ids"):
        resolve_model(str(hub.main), revision="v2")


@pytest.mark.parametrize("name, is_id", [
    ("nvidia/NVIDIA-Nemotron-Labs-Dory1.0-4B-BF16", True),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
    ("smollm2-135m-instruct", False),
    ("/abs/path", False),
    ("./rel/path", False),
    ("a/b/c", False),
    ("org--x/name", False),
    ("org/na..me", False),
    ("org/name.git", False),
    ("~/name", False),
])
def test_what_counts_as_a_hub_id(name, is_id):
    assert is_hub_id(name) is is_id


@pytest.fixture
def busy_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_serve_resolves_a_hub_id_before_loading(busy_port, capsys):
    """`serve ORG/NAME` resolves the id, then fails on the port in use: the model was found (its
    errors come first, and the model never loads)."""
    assert cli_main(["serve", REPO, "--revision", "v2", "--port", str(busy_port)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: port {busy_port} on 127.0.0.1 is already in use (choose another with --port)")
    assert cli_main(["serve", "tiny-org/not-cached", "--port", str(busy_port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'tiny-org/not-cached' is not in the Hugging Face cache" in err[0]
    assert cli_main(["generate", "hi", "--model", REPO, "--revision", "nosuch"]) == 2
    assert "at revision 'nosuch' is not in the Hugging Face cache" in capsys.readouterr().err
    assert cli_main(["serve", REPO, "--model", "tiny-org/other", "--port", str(busy_port)]) == 2
    assert "two models" in capsys.readouterr().err


# ---- downloads, from a stand-in Hub on 127.0.0.1 ----------------------------------------------------------


def skip_if_imported_offline() -> None:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        pytest.skip("HF_HUB_OFFLINE was set when huggingface_hub was imported: it then sends no request at all")


@pytest.fixture
def fake_hub(hub, monkeypatch, tmp_path):
    """A Hub on 127.0.0.1 (HF_ENDPOINT) holding REPO at main (the checkpoint, plus a README and .bin
    weights that are not served) and v2, and a gated copy of main; an empty cache; online."""
    skip_if_imported_offline()
    fake = FakeHub()
    served = checkpoint_files(hub.main)
    fake.repo(REPO).add_commit("main", {**served, "README.md": b"# tiny", "pytorch_model.bin": b"not served"})
    fake.repo(REPO).add_commit("v2", checkpoint_files(hub.v2))
    gated = fake.repo("tiny-org/gated")
    gated.token = "hf_test_token"
    gated.add_commit("main", served)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "downloads"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    for token_variable in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(token_variable, raising=False)
    with serve_fake_hub(fake) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield fake


def _asked_for(fake: FakeHub, repo_id: str) -> list[str]:
    return [request for request in fake.requests if repo_id in request]


def test_a_model_not_cached_is_downloaded_then_served_from_the_cache_offline(hub, fake_hub, direct_tokens,
                                                                             monkeypatch, capfd):
    path = resolve_model(REPO).path
    assert sorted(file.name for file in path.iterdir()) == sorted(checkpoint_files(hub.main))  # no README, no .bin
    assert (path.parents[1] / "refs" / "main").read_text() == path.name
    if not os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"):
        assert "Fetching" in capfd.readouterr().err  # huggingface_hub's progress bar
    assert any(request.startswith(f"GET /{REPO}/resolve/") for request in fake_hub.requests)
    v2 = resolve_model(REPO, revision="v2").path
    assert sorted(file.name for file in v2.iterdir()) == sorted(checkpoint_files(hub.v2)) and v2 != path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub.requests.clear()
    assert greedy_tokens(tiny_llm(REPO)) == direct_tokens["main"]
    assert _asked_for(fake_hub, REPO) == []  # offline: served from the cache alone


def test_a_gated_model_downloads_with_hf_token(fake_hub, monkeypatch):
    with pytest.raises(HubModelError, match=f"'tiny-org/gated' is a gated model: accept its terms on "
                                            f"{os.environ['HF_ENDPOINT']}/tiny-org/gated and set HF_TOKEN"):
        resolve_model("tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    assert (resolve_model("tiny-org/gated").path / "model.safetensors").is_file()


def test_the_hubs_answers_for_an_unknown_id_or_revision(fake_hub):
    with pytest.raises(HubModelError, match="no model 'tiny-org/nothing' on the Hugging Face Hub"):
        resolve_model("tiny-org/nothing")
    with pytest.raises(HubModelError, match="'tiny-org/tiny-llama' on the Hugging Face Hub has no revision 'v9'"):
        resolve_model(REPO, revision="v9")
    assert _asked_for(fake_hub, "tiny-org/nothing") and _asked_for(fake_hub, "v9")


def test_an_unreachable_hub_falls_back_to_the_cache(hub, monkeypatch):
    skip_if_imported_offline()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed}")
    assert resolve_model(REPO).path == hub.main
    with pytest.raises(HubModelError, match="'tiny-org/not-cached' is not in the Hugging Face cache .* and the "
                                            "Hub cannot be reached \\(Connect") as unreachable:
        resolve_model("tiny-org/not-cached")
    assert "\n" not in str(unreachable.value)  # one `error:` line on the command line
