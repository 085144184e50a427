"""S3 sync against a real S3-API server on loopback (moto's standalone server): verified uploads, pull +
resume equal to an uninterrupted run, remote pruning, and a server that goes down mid-upload."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from app.checkpoint.store import save_checkpoint
from app.cli import main
from app.config.schema import StorageConfig
from app.errors import UserError
from app.storage import S3Sync, parse_s3_uri, pull_run, upload_export
from app.storage.remote import RemoteRun
from app.storage.s3 import MIB, digest_file, make_client, remote_mismatch, transfer_config, upload_verified
from app.telemetry import TelemetryWarning
from app.telemetry.reporter import RunStart
from app.telemetry.status import read_status
from app.train.trainer import Trainer, TrainingStopped
from tests.helpers import StopAtStep, dflash, small_config

ROOT = Path(__file__).resolve().parents[1]
SECRET = "dflash-test-secret-never-logged"


@pytest.fixture(scope="module")
def s3_endpoint():
    """moto's S3 server on a free loopback port, with throwaway credentials in the environment only."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ACCESS_KEY_ID", "dflash-test-key")
        env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        env.setenv("AWS_DEFAULT_REGION", "us-east-1")
        env.setenv("AWS_EC2_METADATA_DISABLED", "true")
        env.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
        env.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
        env.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


_buckets = iter(range(1000))


@pytest.fixture
def bucket(s3_endpoint) -> str:
    name = f"dflash-test-{next(_buckets)}"
    make_client(s3_endpoint, 0).create_bucket(Bucket=name)
    return name


def quiet(line: str) -> None:
    pass


def fake_checkpoint(run_dir: Path, step: int, weight_floats: int = 1000) -> Path:
    """A real checkpoint (the store's own format) of a `weight_floats`-sized model."""
    generator = torch.Generator().manual_seed(step)
    return save_checkpoint(
        run_dir, step, {"w": torch.randn(weight_floats, generator=generator)}, {"state": {}, "param_groups": []},
        {"cpu": torch.get_rng_state()}, {"cursor": {"epoch": 0, "batch": step}}, keep_last=10,
    )  # fmt: skip


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_uploads_are_verified_against_the_server_checksum(s3_endpoint, bucket, tmp_path: Path) -> None:
    client = make_client(s3_endpoint, 0)
    big = tmp_path / "big.bin"
    big.write_bytes(torch.randn(11 * MIB // 4, generator=torch.Generator().manual_seed(0)).numpy().tobytes())
    digest = digest_file(big, 5 * MIB)
    assert len(digest.part_digests) == 3
    upload_verified(client, big, bucket, "x/big.bin", digest, transfer_config(5))  # multipart: 3 parts
    head = client.head_object(Bucket=bucket, Key="x/big.bin")
    assert head["ETag"].strip('"').endswith("-3")
    assert remote_mismatch(client, bucket, "x/big.bin", big, digest) is None

    small = tmp_path / "state.json"
    small.write_text('{"step": 3}')
    small_digest = digest_file(small, 5 * MIB)
    upload_verified(client, small, bucket, "x/state.json", small_digest, transfer_config(5))
    stored = client.head_object(Bucket=bucket, Key="x/state.json", ChecksumMode="ENABLED")["ChecksumSHA256"]
    assert stored == small_digest.stored_checksum(multipart=False)  # base64 of the manifest's sha256

    # Same size, other bytes on the server: the check notices.
    client.put_object(Bucket=bucket, Key="x/state.json", Body=b'{"step": 4}', ChecksumAlgorithm="SHA256")
    assert remote_mismatch(client, bucket, "x/state.json", small, small_digest).startswith("SHA-256 mismatch")
    assert remote_mismatch(client, bucket, "x/missing", small, small_digest) == "not uploaded"


def test_pull_and_resume_equals_an_uninterrupted_run(
    tiny_lm_dir, tiny_conversations, tmp_path: Path, s3_endpoint, bucket, capsys, monkeypatch
) -> None:
    """A run preempted after step 2 on one box, pulled from S3 onto another and resumed == 4 steps straight."""
    straight = Trainer(
        small_config(tiny_conversations, tmp_path / "straight", "train.max_steps=4"), log=quiet
    )
    straight_losses = straight.run().losses

    uri = f"s3://{bucket}/runs/first"
    storage = [f"storage.s3_uri={uri}", f"storage.endpoint_url={s3_endpoint}", "storage.multipart_chunk_mb=5"]
    config = small_config(
        tiny_conversations, tmp_path / "first", "train.max_steps=4", "telemetry.log_every=2", *storage
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", TelemetryWarning)
        with pytest.raises(TrainingStopped) as stop:
            Trainer(config, reporters=[StopAtStep(2)], log=quiet).run()
    step = stop.value.step  # the checkpoint written on SIGTERM, after the steps in flight
    stopped = f"step_{step:08d}"
    logged = [json.loads(line) for line in (tmp_path / "first" / "metrics.jsonl").read_text().splitlines()]
    assert logged[0]["step_losses"] == straight_losses[:2]

    client = make_client(s3_endpoint, 0)
    keys = {item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert {f"runs/first/checkpoints/{stopped}/{name}" for name in
            ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json")} <= keys  # fmt: skip
    assert {"runs/first/checkpoints/latest", "runs/first/config.json", "runs/first/metrics.jsonl"} <= keys
    remote_status = json.loads(client.get_object(Bucket=bucket, Key="runs/first/status.json")["Body"].read())
    assert remote_status["state"] == "stopped"  # written before the final round
    remote_storage = json.loads(
        client.get_object(Bucket=bucket, Key="runs/first/storage.json")["Body"].read()
    )
    assert remote_storage["synced_checkpoint"]["name"] == stopped
    assert read_status(tmp_path / "first")["storage"]["synced_checkpoint"]["name"] == stopped

    pulled = tmp_path / "elsewhere"
    monkeypatch.setattr(
        sys, "argv", ["dflash", "pull", uri, "--to", str(pulled), "--endpoint-url", s3_endpoint]
    )
    capsys.readouterr()
    main()  # the console script's entry point, in this process
    done = capsys.readouterr()
    assert f"restored {pulled / 'checkpoints' / stopped} (step {step})" in done.out
    assert SECRET not in done.out + done.err
    assert (pulled / "checkpoints" / "latest").read_text().strip() == stopped

    # the run's drafter exported and put beside its checkpoints, manifest last
    exported = dflash(
        capsys, monkeypatch, "export", str(tmp_path / "first"), "--out", str(tmp_path / "v1"), "--upload"
    )
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.splitlines()[-1] == f"uploaded to {uri}/exports/v1/"
    manifest = json.loads(
        client.get_object(Bucket=bucket, Key="runs/first/exports/v1/manifest.json")["Body"].read()
    )
    assert set(manifest["files"]) == {path.name for path in (tmp_path / "v1").iterdir()}
    local = dflash(
        capsys, monkeypatch, "export", str(tmp_path / "straight"), "--out", str(tmp_path / "v2"), "--upload"
    )
    assert local.returncode == 2 and "--upload: the run has no storage.s3_uri" in local.stderr

    resumed = Trainer(small_config(tiny_conversations, pulled, "train.max_steps=4"), resume=True, log=quiet)
    assert resumed.step == step < 4
    assert resumed.run().losses == straight_losses[step:]
    for name, weight in straight.drafter.state_dict().items():
        assert torch.equal(weight, resumed.drafter.state_dict()[name]), name


class FlakyProxy:
    """A TCP proxy in front of the S3 server that goes down on demand: it stops listening and cuts every
    open connection, optionally once `cut_after` bytes have gone upstream (mid-upload)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.sent = 0
        self.cut_after: int | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                if sock is not None:
                    with contextlib.suppress(OSError):  # already closed by the peer
                        sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            self._sockets, self._listener = [], None

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, upstream: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if upstream:
                    self.sent += len(data)
                    if self.cut_after is not None and self.sent > self.cut_after:
                        self.down()
                        return
                sink.sendall(data)
        except OSError:
            pass


def test_server_down_mid_upload_is_retried_and_nothing_partial_is_visible(
    s3_endpoint, bucket, tmp_path: Path
) -> None:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = FlakyProxy((host, int(port)))
    proxy.up()
    uri = f"s3://{bucket}/runs/flaky"
    storage = StorageConfig(
        s3_uri=uri, endpoint_url=proxy.url, multipart_chunk_mb=5, max_retries=0, retry_interval_s=0.3,
        exit_timeout_s=60,
    )  # fmt: skip
    run_dir = tmp_path / "run"
    checkpoint = fake_checkpoint(run_dir, 7, weight_floats=7 * MIB // 4)  # a 7 MiB model file: 2 parts
    (run_dir / "config.json").write_text("{}")
    sync = S3Sync(storage, keep_last=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sync.on_start(RunStart(run_dir, {}, {}, {}))
        assert sync.wait_idle(60)
        proxy.cut_after = proxy.sent + 6 * MIB  # the server dies inside the model file's second part
        sync.on_checkpoint(checkpoint, 7)
        wait_for(lambda: sync.state()["failed_rounds"] >= 1)

        open_uploads = make_client(s3_endpoint, 0).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        assert [u["Key"] for u in open_uploads] == ["runs/flaky/checkpoints/step_00000007/model.safetensors"]
        direct = RemoteRun(make_client(s3_endpoint, 0), parse_s3_uri(uri), 5)
        assert direct.complete_checkpoints() == [] and direct.latest() is None
        with pytest.raises(UserError, match="no complete checkpoint"):
            pull_run(uri, tmp_path / "too-early", endpoint_url=s3_endpoint)
        assert sync.state()["pending"] == ["step_00000007"]

        proxy.cut_after = None
        proxy.up()  # the server is back: the next round (retry_interval_s) finishes the job
        wait_for(lambda: sync.state()["synced_checkpoint"] is not None)
        sync.on_exit("completed", 7)

    state = sync.state()
    assert state["last_error"] is None and state["pending"] == [] and state["failed_rounds"] >= 1
    failures = [str(w.message) for w in caught if issubclass(w.category, TelemetryWarning)]
    assert failures and all(message.startswith(f"S3 sync to {uri} failed (") for message in failures)
    assert not any(SECRET in str(w.message) for w in caught)
    assert direct.complete_checkpoints() == ["step_00000007"] and direct.latest() == "step_00000007"
    assert make_client(s3_endpoint, 0).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []

    pulled = pull_run(uri, tmp_path / "pulled", endpoint_url=s3_endpoint)
    assert pulled.step == 7 and pulled.run_files == ["config.json", "storage.json"]
    assert json.loads((tmp_path / "pulled" / "storage.json").read_text())["synced_checkpoint"]["step"] == 7
    for name in ("model.safetensors", "optimizer.pt", "rng.pt", "state.json", "manifest.json"):
        assert (pulled.checkpoint / name).read_bytes() == (checkpoint / name).read_bytes()
    proxy.down()


def test_remote_keeps_the_newest_complete_checkpoints_and_exports(
    s3_endpoint, bucket, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/prefix/run"
    storage = StorageConfig(s3_uri=uri, endpoint_url=s3_endpoint, multipart_chunk_mb=5, exit_timeout_s=60)
    sync = S3Sync(storage, keep_last=2)
    sync.on_start(RunStart(tmp_path, {}, {}, {}))
    for step in (1, 2, 3):
        sync.on_checkpoint(fake_checkpoint(tmp_path, step), step)
        assert sync.wait_idle(60)
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
    (export / "model.safetensors").write_bytes(b"weights")
    sync.on_exit("completed", 3)
    upload_export(storage, export)  # what `dflash export --upload` runs

    remote = RemoteRun(make_client(s3_endpoint, 0), parse_s3_uri(uri), 5)
    assert remote.complete_checkpoints() == ["step_00000002", "step_00000003"]
    client = make_client(s3_endpoint, 0)
    keys = {item["Key"] for item in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert not any("step_00000001" in key for key in keys)
    manifest = json.loads(
        client.get_object(Bucket=bucket, Key="prefix/run/exports/export/manifest.json")["Body"].read()
    )
    assert set(manifest["files"]) == {"config.json", "model.safetensors"}

    assert sync.state()["synced_checkpoint"]["step"] == 3


def test_missing_credentials_are_a_warning_not_a_crash(
    s3_endpoint, bucket, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    storage = StorageConfig(
        s3_uri=f"s3://{bucket}/x", endpoint_url=s3_endpoint, exit_timeout_s=5, retry_interval_s=60
    )
    (tmp_path / "config.json").write_text("{}")
    sync = S3Sync(storage, keep_last=1)
    with pytest.warns(TelemetryWarning, match=r"failed \(no AWS credentials"):
        sync.on_start(RunStart(tmp_path, {}, {}, {}))
        wait_for(lambda: sync.state()["failed_rounds"] >= 1)
    assert "no AWS credentials" in sync.state()["last_error"]
    monkeypatch.undo()  # credentials back: the closing round at exit succeeds and the sync thread ends
    sync.on_exit("completed", 0)
    assert sync.state()["last_error"] is None and not sync._thread.is_alive()


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("http://bucket/x", "expected an s3://bucket/prefix URI"),
        ("s3://B/x", "is not a valid bucket name"),
        ("s3://ab", "is not a valid bucket name"),
    ],
)
def test_bad_uris_are_one_line_errors(uri: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        parse_s3_uri(uri)


def test_locations() -> None:
    location = parse_s3_uri("s3://my-bucket/runs/a/")
    assert (location.bucket, location.prefix, str(location)) == (
        "my-bucket",
        "runs/a",
        "s3://my-bucket/runs/a",
    )
    assert location.key("checkpoints", "latest") == "runs/a/checkpoints/latest"
    assert parse_s3_uri("s3://my-bucket").key("config.json") == "config.json"
