"""Hugging Face Hub ids (org/name, @revision, GGUF org/name:QUANT and org/name/FILE.gguf).

No network here: a hub cache is laid out as huggingface_hub lays one out
(models--org--name/{blobs, refs, snapshots/<commit>}; checked with its own
``scan_cache_dir``), and subprocesses run with HF_HUB_CACHE pointing at it and
HF_HUB_OFFLINE=1, so ids resolve through huggingface_hub's download functions
exactly as they do after a download (huggingface_hub reads its environment once,
at import, hence the subprocesses)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_writer import convert_hf_to_gguf

from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL
from tools import tiny

PROMPT = "def fibonacci(n):"


def add_snapshot(cache: Path, repo: str, files: dict, seed: str, refs=("main",)) -> str:
    """One commit of ``repo`` in huggingface_hub's cache layout: content-addressed blobs
    (sha256 for LFS files, the git blob sha1 for others), snapshots/<commit>/<path> as
    relative symlinks to them, and refs/<branch or tag> holding the commit hash."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo}@{seed}".encode()).hexdigest()
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        if name.endswith((".safetensors", ".gguf")):
            blob_id = hashlib.sha256(data).hexdigest()
        else:
            blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = storage / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(data)
        link = storage / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return commit


def folder_files(folder: Path) -> dict:
    return {p.name: p for p in Path(folder).iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tok_dir):
    """A hub cache: the embedded pair under hub ids (the draft with two revisions), the
    embedded target as mlx-community/Qwen3.5-9B-4bit, and a GGUF repo."""
    import huggingface_hub

    root = tmp_path_factory.mktemp("hub")
    cache = root / "hub"
    target, draft = folder_files(DEFAULT_MODEL), folder_files(DEFAULT_DRAFT)
    add_snapshot(cache, "test-org/tiny-target", {**target, "README.md": b"# tiny\n", "sub/extra.json": b"{}"}, "1")
    # draft: tag v1 = an older commit with another config; main = the embedded draft
    old_cfg = json.loads(draft["config.json"].read_text())
    old_cfg["block_size"] = 4
    # (and the head of pull request 1: huggingface_hub keeps the ref refs/pr/1 in the cache's refs/refs/pr/1)
    v1 = add_snapshot(
        cache,
        "test-org/tiny-draft",
        {**draft, "config.json": json.dumps(old_cfg).encode()},
        "1",
        refs=("v1", "refs/pr/1"),
    )
    main = add_snapshot(cache, "test-org/tiny-draft", draft, "2")
    add_snapshot(cache, "mlx-community/Qwen3.5-9B-4bit", target, "1")
    # GGUF repo: the real file is tagged F32; the Q8_0 file is not a GGUF, so picking it fails loudly
    cfg = tiny.target_config()
    hf = tiny.save_hf(tiny.build_target(cfg, seed=4), cfg, root / "hf", tokenizer_dir=tok_dir)
    gguf = convert_hf_to_gguf(hf, root / "tiny-F32.gguf")
    add_snapshot(
        cache,
        "test-org/tiny-GGUF",
        {
            "tiny-F32.gguf": gguf,
            "tiny-Q8_0.gguf": b"not a gguf",
            "mmproj-tiny-F32.gguf": b"x",
            "README.md": b"# gguf\n",
        },
        "1",
        refs=("main", "refs/pr/2"),
    )
    # A split GGUF (the converter's --split-max-tensors), its parts in a subfolder as GGUF repos keep them
    (root / "split").mkdir()
    first = convert_hf_to_gguf(hf, root / "split" / "tiny-BF16.gguf", split_max_tensors=20)
    parts = sorted(first.parent.glob("tiny-BF16-*-of-*.gguf"))
    add_snapshot(cache, "test-org/split-GGUF", {f"BF16/{p.name}": p for p in parts}, "1")
    add_snapshot(cache, "test-org/broken-split-GGUF", {f"BF16/{p.name}": p for p in parts[:1] + parts[2:]}, "1")
    info = huggingface_hub.scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    repos = {r.repo_id: r for r in info.repos}
    assert set(repos) == {
        "test-org/tiny-target",
        "test-org/tiny-draft",
        "mlx-community/Qwen3.5-9B-4bit",
        "test-org/tiny-GGUF",
        "test-org/split-GGUF",
        "test-org/broken-split-GGUF",
    }
    assert {tuple(sorted(r.refs)) for r in repos["test-org/tiny-draft"].revisions} == {("main",), ("refs/pr/1", "v1")}
    env = {
        **os.environ,
        "HF_HOME": str(root / "home"),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONWARNINGS": "default",
    }
    return {"cache": cache, "env": env, "v1": v1, "main": main, "gguf": gguf, "split": [p.name for p in parts]}


def run_py(hub, code: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code], env=hub["env"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_cli(hub, *args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_dflash", *args], env=hub["env"], capture_output=True, text=True, timeout=600
    )


API = """
import json, warnings
import mlx.core as mx
import mlx_dflash
from mlx_dflash.api import DEFAULT_DRAFT, DEFAULT_MODEL
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.hub import DraftHint, resolve

def toks(e):
    return mlx_dflash.generate(e, {prompt!r}, max_tokens=16, adaptive=False).tokens

out = {{}}
hub = mlx_dflash.load("test-org/tiny-target", draft="test-org/tiny-draft", dtype=mx.float32)
local = mlx_dflash.load(DEFAULT_MODEL, draft=DEFAULT_DRAFT, dtype=mx.float32)
out["hub"], out["local"] = toks(hub), toks(local)
out["local_text"] = mlx_dflash.generate(local, {prompt!r}, max_tokens=16, adaptive=False).text
out["paths"] = [str(hub.model_path), str(hub.draft_path)]
out["hub_draft_block"] = hub.draft.block_size
g = mlx_dflash.load("test-org/tiny-GGUF:F32")
out["gguf_path"] = str(g.model_path)
out["gguf"], out["gguf_local"] = toks(g), toks(mlx_dflash.load({gguf!r}))
out["split"] = toks(mlx_dflash.load("test-org/split-GGUF:bf16"))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    e = mlx_dflash.load("mlx-community/Qwen3.5-9B-4bit", dtype=mx.float32)
out["suggested"] = e.suggested_drafts
out["warnings"] = [str(x.message) for x in w if issubclass(x.category, DraftHint)]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    mlx_dflash.load("test-org/tiny-target", draft="test-org/tiny-draft", dtype=mx.float32)
out["warnings_with_draft"] = [str(x.message) for x in w if issubclass(x.category, DraftHint)]
res = {{}}
for spec in {specs!r}:
    try:
        res[spec] = str(resolve(spec))
    except DFlashError as err:
        res[spec] = "error: " + str(err)
out["resolve"] = res
print(json.dumps(out))
"""

SPECS = [
    "test-org/tiny-draft",
    "test-org/tiny-draft@v1",
    "test-org/tiny-draft@main",
    "test-org/tiny-GGUF:F32",
    "test-org/tiny-GGUF:f32",
    "test-org/tiny-GGUF/tiny-F32.gguf",
    "test-org/tiny-GGUF:Q5_K_M",
    "test-org/tiny-GGUF",
    "test-org/tiny-GGUF/other.gguf",
    "test-org/missing",
    "test-org/tiny-draft@nope",
    "test-org/tiny-draft@refs/pr/1",
    "test-org/tiny-draft@refs/pr/9",
    "test-org/tiny-GGUF:F32@refs/pr/2",
    "test-org/tiny-GGUF/tiny-F32.gguf@refs/pr/2",
]


@pytest.fixture(scope="module")
def api(hub):
    specs = SPECS + [f"test-org/tiny-draft@{hub['v1']}"]
    specs += ["test-org/split-GGUF:BF16", f"test-org/split-GGUF/BF16/{hub['split'][-1]}"]
    specs += ["test-org/broken-split-GGUF:BF16", f"test-org/broken-split-GGUF/BF16/{hub['split'][-1]}"]
    return run_py(hub, API.format(prompt=PROMPT, gguf=str(hub["gguf"]), specs=specs))


def test_load_by_hub_id_equals_the_local_folders(hub, api):
    assert api["hub"] == api["local"] and len(api["hub"]) == 16
    cache = str(hub["cache"])
    assert api["paths"][0].startswith(cache + "/models--test-org--tiny-target/snapshots/")
    assert api["paths"][1] == f"{cache}/models--test-org--tiny-draft/snapshots/{hub['main']}"
    assert api["hub_draft_block"] == 16  # main, not the v1 snapshot


def test_revision_picks_its_snapshot(hub, api):
    snap = f"{hub['cache']}/models--test-org--tiny-draft/snapshots/"
    r = api["resolve"]
    assert r["test-org/tiny-draft"] == r["test-org/tiny-draft@main"] == snap + hub["main"]
    assert r["test-org/tiny-draft@v1"] == r[f"test-org/tiny-draft@{hub['v1']}"] == snap + hub["v1"]
    assert json.loads(Path(r["test-org/tiny-draft@v1"], "config.json").read_text())["block_size"] == 4
    assert (
        r["test-org/tiny-draft@nope"].startswith("error: ")
        and "@nope is not in the Hugging Face cache" in r["test-org/tiny-draft@nope"]
    )
    # A pull request's head (huggingface_hub's revision refs/pr/N), for a folder and a GGUF file
    assert r["test-org/tiny-draft@refs/pr/1"] == snap + hub["v1"]
    assert "@refs/pr/9 is not in the Hugging Face cache" in r["test-org/tiny-draft@refs/pr/9"]
    gguf = r["test-org/tiny-GGUF:F32"]
    assert r["test-org/tiny-GGUF:F32@refs/pr/2"] == r["test-org/tiny-GGUF/tiny-F32.gguf@refs/pr/2"] == gguf


def test_gguf_repo_resolves_the_one_named_file(hub, api):
    r = api["resolve"]
    f32 = f"{hub['cache']}/models--test-org--tiny-GGUF/snapshots/"
    assert r["test-org/tiny-GGUF:F32"].startswith(f32) and r["test-org/tiny-GGUF:F32"].endswith("/tiny-F32.gguf")
    assert r["test-org/tiny-GGUF:f32"] == r["test-org/tiny-GGUF/tiny-F32.gguf"] == r["test-org/tiny-GGUF:F32"]
    assert api["gguf_path"] == r["test-org/tiny-GGUF:F32"]
    assert api["gguf"] == api["gguf_local"] and len(api["gguf"]) == 16
    # no such tag: the files there; no tag at all: name one; no such file: the hub's answer
    assert r["test-org/missing"].startswith("error: 'test-org/missing' is not a local path")
    assert "no GGUF file tagged 'Q5_K_M'" in r["test-org/tiny-GGUF:Q5_K_M"]
    assert "tiny-F32.gguf, tiny-Q8_0.gguf" in r["test-org/tiny-GGUF:Q5_K_M"]  # mmproj files left out
    assert "is a GGUF repo: name one file" in r["test-org/tiny-GGUF"]
    assert r["test-org/tiny-GGUF/other.gguf"].startswith("error: ")


def test_split_gguf_repo_resolves_to_its_parts(hub, api):
    r, names = api["resolve"], hub["split"]
    assert len(names) >= 3
    snap = f"{hub['cache']}/models--test-org--split-GGUF/snapshots/"
    assert r["test-org/split-GGUF:BF16"].startswith(snap) and r["test-org/split-GGUF:BF16"].endswith("/" + names[0])
    assert r[f"test-org/split-GGUF/BF16/{names[-1]}"].endswith("/" + names[-1])
    assert api["split"] == api["gguf_local"]  # the parts load as the whole file does
    # A part missing: named, whichever part (or the tag) was asked for, before anything is fetched.
    for spec in ("test-org/broken-split-GGUF:BF16", f"test-org/broken-split-GGUF/BF16/{names[-1]}"):
        assert r[spec].startswith("error: ") and r[spec].endswith(f"holds no BF16/{names[1]}"), r[spec]


def test_missing_repo_is_one_clear_error(hub):
    r = run_cli(hub, "generate", "-m", "test-org/missing", "hi", "-n", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "test-org/missing" in lines[0], r.stderr
    assert "HF_HUB_OFFLINE" in lines[0] and "Traceback" not in r.stderr


def test_a_file_name_the_hub_refuses_is_one_clear_error(hub):
    r = run_cli(hub, "generate", "-m", "test-org/tiny/../../x.gguf", "hi", "-n", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: 'test-org/tiny/../../x.gguf' is not a local path") and "'..'" in r.stderr


def test_cli_generate_by_hub_id_equals_local_paths(hub, api):
    r = run_cli(
        hub,
        "generate",
        "-m",
        "test-org/tiny-target",
        "-d",
        "test-org/tiny-draft",
        PROMPT,
        "-n",
        "16",
        "--dtype",
        "float32",
        "--no-adaptive",
        "--no-chat-template",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == api["local_text"] + "\n" and len(api["local_text"]) > 10  # the local folders' text
    assert "no draft given" not in r.stderr


def test_draft_suggested_when_d_is_omitted(hub, api):
    assert api["suggested"] == ["z-lab/Qwen3.5-9B-DFlash"]
    assert len(api["warnings"]) == 1 and "z-lab/Qwen3.5-9B-DFlash" in api["warnings"][0]
    assert api["warnings_with_draft"] == []
    r = run_cli(hub, "generate", "-m", "mlx-community/Qwen3.5-9B-4bit", PROMPT, "-n", "4", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    hints = [ln for ln in r.stderr.splitlines() if "z-lab/Qwen3.5-9B-DFlash" in ln]
    assert len(hints) == 1 and "no draft given" in hints[0] and "Warning" not in r.stderr, r.stderr


def test_suggestion_by_config_survives_renamed_folders():
    from mlx_dflash.loading.hub import PUBLISHED_DRAFTS, suggest_draft

    text = lambda h, n, mt="qwen3_5_text", **kw: {
        "model_type": "qwen3_5",  # noqa: E731
        "text_config": {"model_type": mt, "hidden_size": h, "num_hidden_layers": n, **kw},
    }
    assert suggest_draft(text(4096, 32), "my-model") == ["z-lab/Qwen3.5-9B-DFlash"]
    assert suggest_draft(text(2560, 32), "") == ["z-lab/Qwen3.5-4B-DFlash"]
    # Qwen3.6 has Qwen3.5's shapes: the name picks, else both are named
    assert suggest_draft(text(5120, 64), "unsloth/Qwen3.6-27B-MLX-8bit") == ["z-lab/Qwen3.6-27B-DFlash"]
    assert suggest_draft(text(5120, 64), "q27") == ["z-lab/Qwen3.5-27B-DFlash", "z-lab/Qwen3.6-27B-DFlash"]
    moe = text(2048, 40, "qwen3_5_moe_text", num_experts=256)
    assert suggest_draft(moe, "renamed") == ["z-lab/Qwen3.5-35B-A3B-DFlash", "z-lab/Qwen3.6-35B-A3B-DFlash"]
    # a config that fits none: the name decides; a 9B-shaped config wins over a misleading name
    assert suggest_draft(text(64, 4), "mlx-community/Qwen3.5-122B-A10B-4bit") == ["z-lab/Qwen3.5-122B-A10B-DFlash"]
    assert suggest_draft(text(64, 4), "mlx-community/Qwen3.5-0.8B-4bit") == []
    assert suggest_draft(text(4096, 32), "Qwen3.5-27B") == ["z-lab/Qwen3.5-9B-DFlash"]
    assert all(d[2].startswith("z-lab/") for d in PUBLISHED_DRAFTS)


def test_what_counts_as_a_hub_id(tmp_path):
    from mlx_dflash.loading.hub import parse, resolve

    assert parse("mlx-community/Qwen3.5-9B-4bit") == ("mlx-community/Qwen3.5-9B-4bit", None, None, None)
    assert parse("z-lab/Qwen3.5-9B-DFlash@v1") == ("z-lab/Qwen3.5-9B-DFlash", "v1", None, None)
    assert parse("unsloth/Qwen3.5-9B-GGUF:Q4_K_M") == ("unsloth/Qwen3.5-9B-GGUF", None, "Q4_K_M", None)
    assert parse("org/repo/sub/m-Q8_0.gguf@abc") == ("org/repo", "abc", None, "sub/m-Q8_0.gguf")
    # full git refs as huggingface_hub takes them as a revision: a pull request's, a branch's, a tag's
    assert parse("org/name@refs/pr/1") == ("org/name", "refs/pr/1", None, None)
    assert parse("org/name:Q4_K_M@refs/pr/12") == ("org/name", "refs/pr/12", "Q4_K_M", None)
    assert parse("org/name/sub/m-Q8_0.gguf@refs/pr/3") == ("org/name", "refs/pr/3", None, "sub/m-Q8_0.gguf")
    assert parse("org/name@refs/heads/feature/x-1.2") == ("org/name", "refs/heads/feature/x-1.2", None, None)
    assert parse("org/name:Q8_0@refs/tags/v1.0") == ("org/name", "refs/tags/v1.0", "Q8_0", None)
    for not_a_ref in ("refs/pr/x", "refs/pr/1/2", "refs/other/1", "refs/heads/", "refs/heads/../../x", "pr/1", ".."):
        assert parse(f"org/name@{not_a_ref}") is None, not_a_ref
    for not_an_id in ("/abs/m", "~/models/m", "./m/x", "a/b/c", "model", "a--b/c", "a/b:c/d"):
        assert parse(not_an_id) is None, not_an_id
    # a local path that exists wins over the id it spells
    (tmp_path / "org" / "name").mkdir(parents=True)
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert resolve("org/name") == Path("org/name")
    finally:
        os.chdir(cwd)


# --- the download path, against a local stand-in for the Hub -------------------------------


class FakeHub:
    """The few Hub endpoints huggingface_hub's downloads call (repo info, tree listing,
    HEAD/GET of resolve/), served from memory on 127.0.0.1; logs the files fetched."""

    def __init__(self, repos: dict, gated=()):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.repos, self.gated, self.fetched = repos, set(gated), []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def reply(self, code, data=b"", headers=(), body=True):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def error(self, code, err, body):
                self.reply(code, b"{}", [("X-Error-Code", err), ("Content-Type", "application/json")], body)

            def answer(self, body):
                from urllib.parse import unquote, urlparse

                parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
                api = parts[0] == "api"
                if api:
                    parts = parts[2:]  # api/models/
                repo, rest = "/".join(parts[:2]), parts[2:]
                if repo not in hub.repos:
                    return self.error(404 if api else 401, "RepoNotFound", body)
                commits = hub.repos[repo]
                kind, rev, path = rest[0], rest[1], "/".join(rest[2:])
                if rev not in commits:
                    rev = next((c for c in commits if commits[c]["refs"] and rev in commits[c]["refs"]), None)
                if rev is None:
                    return self.error(404, "RevisionNotFound", body)
                files = commits[rev]["files"]
                if api and kind == "revision":
                    info = {"id": repo, "sha": rev, "siblings": [{"rfilename": f} for f in files]}
                    return self.reply(200, json.dumps(info).encode(), [("Content-Type", "application/json")], body)
                if api and kind == "tree":
                    tree = [
                        {"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                        for f, d in files.items()
                    ]
                    return self.reply(200, json.dumps(tree).encode(), [("Content-Type", "application/json")], body)
                if repo in hub.gated:
                    return self.error(403, "GatedRepo", body)
                if path not in files:
                    return self.error(404, "EntryNotFound", body)
                if body:
                    hub.fetched.append(f"{repo}/{path}")
                data = files[path]
                self.reply(200, data, [("X-Repo-Commit", rev), ("ETag", f'"{hashlib.sha256(data).hexdigest()}"')], body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def read_all(files: dict) -> dict:
    return {k: v if isinstance(v, bytes) else Path(v).read_bytes() for k, v in files.items()}


DOWNLOAD = """
import json, warnings
import mlx.core as mx
import mlx_dflash
from mlx_dflash.errors import DFlashError
from mlx_dflash.loading.hub import resolve

out = {}
e = mlx_dflash.load("test-org/tiny-target", draft="test-org/tiny-draft@v1", dtype=mx.float32)
out["tokens"] = mlx_dflash.generate(e, "def fibonacci(n):", max_tokens=16, adaptive=False).tokens
out["draft_block"] = e.draft.block_size
out["gguf"] = str(resolve("test-org/tiny-GGUF:F32"))
out["split"] = str(resolve("test-org/split-GGUF:BF16"))
out["pr"] = str(resolve("test-org/tiny-draft@refs/pr/1"))
for spec in ("test-org/missing", "test-org/gated", "test-org/tiny-target@nope", "test-org/tiny-GGUF/other.gguf"):
    try:
        resolve(spec)
        out[spec] = "resolved"
    except DFlashError as err:
        out[spec] = str(err)
print(json.dumps(out))
"""


@pytest.mark.slow  # 32 s: a local hub serving two repos (resolution is tested by default)
def test_download_fetches_only_what_loads_then_works_offline(hub, tmp_path):
    target, draft = read_all(folder_files(DEFAULT_MODEL)), read_all(folder_files(DEFAULT_DRAFT))
    old = json.loads(draft["config.json"])
    old["block_size"] = 8
    gguf = Path(hub["gguf"]).read_bytes()
    snap = next((hub["cache"] / "models--test-org--split-GGUF" / "snapshots").iterdir())
    split = {f"BF16/{n}": (snap / "BF16" / n).read_bytes() for n in hub["split"]}
    extras = {
        "README.md": b"# tiny\n",
        "modeling_tiny.py": b"raise SystemExit\n",
        "sub/other.safetensors": b"x",
        ".gitattributes": b"*.safetensors filter=lfs\n",
    }
    fake = FakeHub(
        {
            "test-org/tiny-target": {"c" * 40: {"refs": ["main"], "files": {**target, **extras}}},
            "test-org/tiny-draft": {
                "a" * 40: {"refs": ["v1", "refs/pr/1"], "files": {**draft, "config.json": json.dumps(old).encode()}},
                "b" * 40: {"refs": ["main"], "files": draft},
            },
            "test-org/tiny-GGUF": {
                "d" * 40: {
                    "refs": ["main"],
                    "files": {
                        "tiny-F32.gguf": gguf,
                        "tiny-Q8_0.gguf": b"GGUF" + bytes(1 << 20),
                        "mmproj-tiny-F32.gguf": b"x",
                    },
                }
            },
            "test-org/gated": {"e" * 40: {"refs": ["main"], "files": {"config.json": b"{}"}}},
            "test-org/split-GGUF": {"f" * 40: {"refs": ["main"], "files": split}},
        },
        gated={"test-org/gated"},
    )
    env = {**hub["env"], "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_ENDPOINT": fake.url, "HF_TOKEN": ""}
    del env["HF_HUB_OFFLINE"]
    try:
        r = subprocess.run([sys.executable, "-c", DOWNLOAD], env=env, capture_output=True, text=True, timeout=600)
    finally:
        fake.close()
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(fake.fetched) == sorted(
        [f"test-org/tiny-target/{f}" for f in target]
        + [f"test-org/tiny-draft/{f}" for f in draft]
        + ["test-org/tiny-GGUF/tiny-F32.gguf"]
        + [f"test-org/split-GGUF/{f}" for f in split]
    )  # no README, code, subfolder, other GGUF; every part of a split one
    assert "Fetching" in r.stderr  # huggingface_hub's progress bars
    assert out["draft_block"] == 8 and out["gguf"].endswith("/tiny-F32.gguf")
    assert out["split"].endswith("/BF16/" + hub["split"][0])
    assert out["pr"].endswith("/snapshots/" + "a" * 40)  # a pull request's revision, asked of the Hub as that
    assert "no repo test-org/missing on the Hub" in out["test-org/missing"]
    assert "test-org/gated is gated" in out["test-org/gated"]
    assert "has no revision 'nope'" in out["test-org/tiny-target@nope"]
    assert out["test-org/tiny-GGUF/other.gguf"].endswith("test-org/tiny-GGUF has no file other.gguf")
    # the Hub gone (server closed, HF_HUB_OFFLINE unset): the cached files are used
    r2 = subprocess.run(
        [sys.executable, "-c", DOWNLOAD.replace('"test-org/tiny-GGUF:F32"', '"test-org/tiny-GGUF/tiny-F32.gguf"')],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r2.returncode == 0, r2.stderr
    out2 = json.loads(r2.stdout.strip().splitlines()[-1])
    assert out2["tokens"] == out["tokens"] and out2["draft_block"] == 8 and out2["gguf"] == out["gguf"]
    assert out2["pr"] == out["pr"]
    assert "not in the Hugging Face cache and the Hub cannot be reached" in out2["test-org/missing"]
    # one failed request says the Hub is gone: no download retried with backoff (25 s of "Retrying" lines)
    assert "Retrying" not in r2.stderr


def test_a_relative_path_on_the_command_line_stays_a_path(capsys, tmp_path, monkeypatch):
    """The CLI read -m ./org/name as the Hub id org/name: its Path type dropped
    the "./" that marks a path. Now it is the path, and missing, one error."""
    from test_cli import cli

    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "info", "--draft", "./org/name", str(tmp_path))
    assert code == 2 and "draft path does not exist" in err and "Hugging Face" not in err
    code, _, err = cli(capsys, "generate", "hi", "-m", "./org/name")
    assert code == 2 and "model path does not exist" in err and "Hugging Face" not in err
