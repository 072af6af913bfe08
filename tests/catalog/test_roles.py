"""The three roles (reader, writer, admin), run under the credentials `casckpt init --print-grants`
describes: PostgreSQL login roles created in pgserver and granted exactly the printed SQL, and
IAM users on a moto server that enforces their printed policies.

What each role may do is found by running it: a writer commits, tags and soft-deletes; gc as a
writer is refused before anything changes (catalog rows and objects hashed before and after);
gc as admin reclaims; a reader restores and lists.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.catalog import schema
from casckpt.cli.main import app
from casckpt.cli.shared import EXIT_DENIED
from casckpt.errors import AccessDeniedError, RefNotFoundError
from casckpt.testing.internals import internals


def print_grants(role: str, *args: str) -> dict[str, Any]:
    """What `casckpt init ... --print-grants ROLE --json` prints, as a dict."""
    result = CliRunner().invoke(app, ["init", *args, "--print-grants", role, "--json"])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}


def catalog_dump(url: str) -> list[tuple[str, list[str]]]:
    """Every row of every catalog table, as sorted reprs (read with the owner's rights)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [(t.name, sorted(repr(tuple(r)) for r in conn.execute(sa.select(t))))
                    for t in schema.metadata.sorted_tables]
    finally:
        engine.dispose()


def tree_hash(root: Path) -> dict[str, str]:
    """Path -> BLAKE2 of the content of every file under ``root``, but ``tmp/`` (the scratch
    files of open store handles, removed when they close)."""
    return {str(p.relative_to(root)): hashlib.blake2b(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).parts[0] != "tmp"}


# -- the printed statements themselves ------------------------------------------------------

def test_print_grants_creates_nothing_and_covers_every_table(tmp_path: Path) -> None:
    target = tmp_path / "not-yet"
    doc = print_grants("writer", str(target), "--role-name", "trainer")
    assert not target.exists()
    sql = "\n".join(doc["sql"])
    for table in schema.metadata.sorted_tables:
        assert f'"public"."{table.name}" TO "trainer"' in sql
    deletes = [line for line in doc["sql"] if "DELETE" in line and not line.startswith("--")]
    assert deletes == ['GRANT SELECT, INSERT, DELETE ON TABLE "public"."leases" TO "trainer";']
    assert '"public"."runs_id_seq"' in sql
    actions = {a for st in doc["s3_policy"]["Statement"] for a in st["Action"]}
    assert "s3:PutObject" in actions and "s3:DeleteObject" not in actions
    assert "BUCKET" in json.dumps(doc["s3_policy"])  # no store: placeholders


def test_print_grants_reads_the_store_config_and_text_output(tmp_path: Path) -> None:
    (tmp_path / "casckpt.toml").write_text('[store]\nformat = 1\nblobs = "s3://ckpts/team/a"\n')
    doc = print_grants("admin", str(tmp_path))
    resources = {st["Resource"] for st in doc["s3_policy"]["Statement"]}
    assert resources == {"arn:aws:s3:::ckpts/team/a/*", "arn:aws:s3:::ckpts"}
    assert "s3:DeleteObject" in doc["s3_policy"]["Statement"][0]["Action"]
    text = CliRunner().invoke(app, ["init", str(tmp_path), "--print-grants", "reader"])
    assert text.exit_code == 0
    assert 'GRANT SELECT ON TABLE "public"."packs" TO "casckpt_reader";' in text.stdout
    assert '"s3:GetObject"' in text.stdout and "s3:PutObject" not in text.stdout
    bad = CliRunner().invoke(app, ["init", "--print-grants", "owner"])
    assert bad.exit_code == 2 and "reader, writer, admin" in bad.output
    bad = CliRunner().invoke(app, ["init", "--print-grants", "reader", "--role-name", "x; DROP"])
    assert bad.exit_code == 2


# -- PostgreSQL: login roles granted the printed SQL ------------------------------------------

@pytest.fixture
def pg_roles(pg_server: Any, new_pg_url: Callable[[], str], tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A store (local blobs) whose catalog URL names no user, so ``PGUSER`` picks the role,
    and three login roles granted what `--print-grants` printed for each."""
    owner_url = new_pg_url()
    url = owner_url.replace("postgresql+psycopg://postgres:@/", "postgresql+psycopg:///", 1)
    assert url != owner_url
    monkeypatch.setenv("PGUSER", "postgres")
    root = tmp_path / "store"
    casckpt.open(root, catalog=url).close()
    names = {}
    suffix = uuid.uuid4().hex[:8]
    engine = sa.create_engine(owner_url)
    for role in ("reader", "writer", "admin"):
        names[role] = f"casckpt_{role}_{suffix}"
        pg_server.psql(f"CREATE ROLE {names[role]} LOGIN;")
        doc = print_grants(role, str(root), "--role-name", names[role])
        with engine.begin() as conn:
            conn.exec_driver_sql("\n".join(doc["sql"]))  # the printed statements, as printed
    engine.dispose()
    return {"root": root, "owner_url": owner_url, "names": names}  # roles die with the server


def as_role(monkeypatch: pytest.MonkeyPatch, roles: dict[str, Any], role: str) -> casckpt.Store:
    monkeypatch.setenv("PGUSER", roles["names"][role])
    return casckpt.open(roles["root"])


def test_postgres_roles(pg_roles: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    root, owner_url = pg_roles["root"], pg_roles["owner_url"]
    with as_role(monkeypatch, pg_roles, "writer") as writer:
        first = writer.commit(state(1), run="r", step=1, tags=["best"])
        second = writer.commit(state(2), run="r", step=2, tags=["best"])  # moves the tag
        writer.tag("r@2", "release")
        writer.delete("r@1")  # a soft delete: an UPDATE, no row deleted
        writer.retention.set("r", keep_last=5)
        assert writer.ops.check(read_data=True).ok
        before = catalog_dump(owner_url), tree_hash(root)
        with pytest.raises(AccessDeniedError) as refused:
            writer.gc(grace=0)
        assert refused.value.right is not None and refused.value.right.startswith("DELETE on table ")
        assert "admin" in str(refused.value)
        with pytest.raises(AccessDeniedError):
            writer.gc(dry_run=True)
        with pytest.raises(AccessDeniedError, match="repair needs"):
            writer.ops.repair()
        with pytest.raises(AccessDeniedError, match="migrate-trees needs"):
            writer.ops.migrate_trees()
    assert (catalog_dump(owner_url), tree_hash(root)) == before  # nothing marked, condemned, deleted

    result = CliRunner().invoke(app, ["--store", str(root), "gc", "--grace", "0"])
    assert result.exit_code == EXIT_DENIED and "DELETE on table" in result.output
    assert (catalog_dump(owner_url), tree_hash(root)) == before

    with as_role(monkeypatch, pg_roles, "reader") as reader:
        assert [v.id for v in reader.log("r")] == [second.id]
        restored = reader.restore("tag:release")
        assert torch.equal(restored["w"], state(2)["w"])
        assert reader.ops.check().ok
    assert catalog_dump(owner_url) == before[0]

    with as_role(monkeypatch, pg_roles, "admin") as admin:
        report = admin.gc(grace=0)
        assert report.versions_purged == 1 and report.bytes_freed > 0
        assert admin.ops.check(read_data=True).ok
        assert torch.equal(admin.restore("r@2")["b"], state(2)["b"])
        with pytest.raises(RefNotFoundError):
            admin.undelete(first.id)  # purged


# -- S3: a moto server enforcing the printed IAM policies ---------------------------------------

# The IAM action AWS authorizes each of casckpt's S3 requests under -> the names moto checks
# instead. AWS ("Actions, resources, and condition keys for Amazon S3" and each API page):
# ListObjectsV2 needs s3:ListBucket (there is no s3:ListObjectsV2 action), HeadObject needs
# s3:GetObject, CreateMultipartUpload/UploadPart/CompleteMultipartUpload need s3:PutObject.
# moto 5.2 (moto/s3/responses.py sets data["Action"] to the operation's name) checks
# s3:ListObjectsV2, s3:HeadObject and the three multipart operation names, so real S3 grants
# these requests under the printed policy and moto refuses them.
MOTO_ACTIONS = {
    "s3:ListBucket": ["s3:ListObjectsV2"],
    "s3:GetObject": ["s3:HeadObject"],
    "s3:PutObject": ["s3:CreateMultipartUpload", "s3:UploadPart", "s3:CompleteMultipartUpload"],
}


def for_moto(policy: dict[str, Any]) -> dict[str, Any]:
    """``policy`` as moto must be given it to enforce what AWS enforces: every statement also
    names the operations moto checks in place of each of its IAM actions (same Effect,
    Resource and Condition). The printed policy is what AWS documents; moto names actions after
    API operations (see MOTO_ACTIONS). moto also evaluates only StringEquals conditions (and S3
    requests carry no condition values), so the s3:prefix condition of the listing statement
    is not enforced there: these tests cannot show a listing outside the prefix is refused."""
    statements = []
    for statement in policy["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        extra = [name for action in actions for name in MOTO_ACTIONS.get(action, [])]
        statements.append({**statement, "Action": [*actions, *extra]})
    return {**policy, "Statement": statements}


def test_a_writer_reads_history_where_it_may_not_record_the_index(pg_roles: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # versions whose rows are unusable (a deleted base, a restarted trainer's first commit) are
    # indexed from their trees by history; recording them deletes rows, which a writer may not:
    # the answer must come all the same
    with as_role(monkeypatch, pg_roles, "writer") as writer:
        for step in range(1, 5):
            writer.commit(state(step), run="r", step=step)
        writer.delete("r@3")
        assert [(e.version.step, e.change) for e in writer.history("r", "w")] == [
            (1, "added"), (2, "changed"), (4, "changed")]
    with as_role(monkeypatch, pg_roles, "writer") as writer:  # a restart: the first commit has no rows
        writer.commit(state(9), run="r", step=9)
    with as_role(monkeypatch, pg_roles, "writer") as writer:
        assert [e.version.step for e in writer.history("r", "w")] == [1, 2, 4, 9]
    with as_role(monkeypatch, pg_roles, "reader") as reader:
        assert [e.version.step for e in reader.history("r", "w")] == [1, 2, 4, 9]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def iam_moto(aws_env: None, tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A moto server of its own on 127.0.0.1 that enforces IAM after its first three calls
    (which create an all-powerful user to set up the rest); yields its URL and that user's keys."""
    boto3 = pytest.importorskip("boto3")
    port = _free_port()
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    log = (tmp_path / "moto.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "moto did not start"
                time.sleep(0.1)
        iam = boto3.client("iam", endpoint_url=url)
        iam.create_user(UserName="root")
        iam.put_user_policy(UserName="root", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        key = iam.create_access_key(UserName="root")["AccessKey"]
        yield url, {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_s3_roles(iam_moto: tuple[str, dict[str, str]], tmp_path: Path,
                  monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    from botocore.exceptions import ClientError

    url, root_keys = iam_moto
    s3 = boto3.client("s3", endpoint_url=url, **root_keys)
    iam = boto3.client("iam", endpoint_url=url, **root_keys)
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):  # IAM is enforced: unknown keys fail
        boto3.client("s3", endpoint_url=url).list_buckets()
    s3.create_bucket(Bucket="ckpts")
    blobs = "s3://ckpts/team/store"
    keys = {}
    for role in ("reader", "writer", "admin"):
        policy = print_grants(role, "--blobs", blobs)["s3_policy"]
        iam.create_user(UserName=role)
        iam.put_user_policy(UserName=role, PolicyName="casckpt", PolicyDocument=json.dumps(for_moto(policy)))
        keys[role] = iam.create_access_key(UserName=role)["AccessKey"]

    root = tmp_path / "store"
    catalog = f"sqlite:///{tmp_path / 'catalog.db'}"

    def open_as(role: str) -> casckpt.Store:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys[role]["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys[role]["SecretAccessKey"])
        return casckpt.open(root, blobs=blobs, catalog=catalog, s3={"endpoint_url": url})

    def objects() -> dict[str, str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket="ckpts")
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}

    open_as("admin").close()  # creating the store writes its identity record
    with open_as("writer") as writer:
        writer.commit(state(1), run="r", step=1)
        second = writer.commit(state(2), run="r", step=2, tags=["release"])
        writer.delete("r@1")
        assert writer.ops.check(read_data=True).ok
        before = catalog_dump(catalog), objects()
        with pytest.raises(AccessDeniedError) as refused:
            writer.gc(grace=0)
        assert refused.value.right is not None
        assert refused.value.right.startswith("s3:DeleteObject on arn:aws:s3:::ckpts/team/store/")
        assert "CasckptObjects0" in str(refused.value)  # the admin statement that would allow it
        # a writer's deletion (a pack write below quorum cleaning up) is logged, not raised
        locations = internals(writer).locations  # the one path every object deletion takes
        some_key = next(iter(before[1])).removeprefix("team/store/")
        assert locations.delete([(locations.all[0].id, some_key)]) == []
    assert (catalog_dump(catalog), objects()) == before

    with open_as("reader") as reader:
        assert [v.id for v in reader.log("r")] == [second.id]
        assert torch.equal(reader.restore("tag:release")["w"], state(2)["w"])
    assert objects() == before[1]

    with open_as("admin") as admin:
        report = admin.gc(grace=0)
        assert report.versions_purged == 1 and report.bytes_freed > 0
        assert admin.ops.check(read_data=True).ok
    assert len(objects()) < len(before[1])


# -- S3: a refused request is reported as denied, and nothing is deleted -------------------------

def without(policy: dict[str, Any], action: str) -> dict[str, Any]:
    """``policy`` with ``action`` taken out of every statement (statements left empty dropped)."""
    statements = [{**st, "Action": [a for a in st["Action"] if a != action]} for st in policy["Statement"]]
    return {**policy, "Statement": [st for st in statements if st["Action"]]}


def denying(policy: dict[str, Any], action: str, resource: str) -> dict[str, Any]:
    """``policy`` plus an explicit Deny of ``action`` on ``resource``."""
    deny = {"Sid": "TestDeny", "Effect": "Deny", "Action": [action], "Resource": resource}
    return {**policy, "Statement": [*policy["Statement"], deny]}


class S3Users:
    """A bucket ``ckpts`` on an IAM-enforcing moto server, a store on ``s3://ckpts/team/store`` and
    IAM users made on demand from a policy (given as AWS documents it; :func:`for_moto` applies)."""

    blobs = "s3://ckpts/team/store"

    def __init__(self, url: str, root_keys: dict[str, str], tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        import boto3

        self.url, self.monkeypatch = url, monkeypatch
        self.s3 = boto3.client("s3", endpoint_url=url, **root_keys)
        self.iam = boto3.client("iam", endpoint_url=url, **root_keys)
        self.s3.create_bucket(Bucket="ckpts")
        self.root, self.catalog = tmp_path / "store", f"sqlite:///{tmp_path / 'catalog.db'}"
        self.keys: dict[str, dict[str, str]] = {}

    def user(self, name: str, policy: dict[str, Any]) -> str:
        self.iam.create_user(UserName=name)
        self.iam.put_user_policy(UserName=name, PolicyName="casckpt",
                                 PolicyDocument=json.dumps(for_moto(policy)))
        self.keys[name] = self.iam.create_access_key(UserName=name)["AccessKey"]
        return name

    def become(self, name: str) -> None:
        """Use ``name``'s keys (for the API and the CLI) from now on."""
        self.monkeypatch.setenv("AWS_ACCESS_KEY_ID", self.keys[name]["AccessKeyId"])
        self.monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", self.keys[name]["SecretAccessKey"])
        self.monkeypatch.setenv("AWS_ENDPOINT_URL", self.url)

    def open(self, name: str) -> casckpt.Store:
        self.become(name)
        return casckpt.open(self.root, blobs=self.blobs, catalog=self.catalog, s3={"endpoint_url": self.url})

    def objects(self) -> dict[str, str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket="ckpts")
        return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}

    def state(self) -> tuple[list[tuple[str, list[str]]], dict[str, str]]:
        """Every catalog row and every object (with its ETag)."""
        return catalog_dump(self.catalog), self.objects()


@pytest.fixture
def s3_users(iam_moto: tuple[str, dict[str, str]], tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> S3Users:
    return S3Users(*iam_moto, tmp_path, monkeypatch)


def test_s3_listing_refused_at_creation_is_denied_not_foreign_data(s3_users: S3Users) -> None:
    admin = print_grants("admin", "--blobs", S3Users.blobs)["s3_policy"]
    s3_users.user("nolist", without(admin, "s3:ListBucket"))
    with pytest.raises(AccessDeniedError) as refused:
        s3_users.open("nolist")
    assert refused.value.right == "s3:ListBucket on arn:aws:s3:::ckpts with s3:prefix 'team/store/manifests/'"
    message = str(refused.value)
    assert "s3://ckpts/team/store/manifests/" in message  # the location
    assert '"Sid":"CasckptList0"' in message and "--print-grants reader" in message  # what allows it
    assert "no identity record" not in message
    assert s3_users.objects() == {}
    s3_users.become("nolist")
    other = s3_users.root.parent / "other"
    created = CliRunner().invoke(app, ["init", str(other), "--blobs", S3Users.blobs,
                                       "--catalog", f"sqlite:///{other.parent / 'other.db'}"])
    assert created.exit_code == EXIT_DENIED and "s3:ListBucket" in created.output, created.output
    assert s3_users.objects() == {}


def test_s3_denials_stop_check_gc_and_repair_and_delete_nothing(s3_users: S3Users) -> None:
    admin = print_grants("admin", "--blobs", S3Users.blobs)["s3_policy"]
    s3_users.user("admin", admin)
    s3_users.user("nolist", without(admin, "s3:ListBucket"))
    s3_users.user("nopacks", denying(admin, "s3:GetObject", "arn:aws:s3:::ckpts/team/store/packs/*"))
    with s3_users.open("admin") as store:
        store.commit(state(1), run="r", step=1)
        store.commit(state(2), run="r", step=2)
        store.delete("r@1")  # gc has a version to purge and objects to delete
    before = s3_users.state()

    with s3_users.open("nolist") as store:  # the identity record is read, not listed
        for call in (lambda: store.ops.check(), lambda: store.gc(grace=0), lambda: store.ops.repair()):
            with pytest.raises(AccessDeniedError) as refused:
                call()
            assert refused.value.right is not None and refused.value.right.startswith("s3:ListBucket on ")
            assert "CasckptList0" in str(refused.value)
    assert s3_users.state() == before

    with s3_users.open("nopacks") as store:
        for call in (lambda: store.ops.check(read_data=True), lambda: store.restore("r@2")):
            with pytest.raises(AccessDeniedError) as refused:
                call()
            assert refused.value.right is not None
            assert refused.value.right.startswith("s3:GetObject on arn:aws:s3:::ckpts/team/store/packs/")
            assert "CasckptObjects0" in str(refused.value)
    assert s3_users.state() == before

    # records (refs/): a refused read of one is not a damaged record for repair to rewrite
    s3_users.user("norefs", denying(admin, "s3:GetObject", "arn:aws:s3:::ckpts/team/store/refs/*"))
    with s3_users.open("norefs") as store:
        for call in (lambda: store.ops.check(), lambda: store.ops.repair()):
            with pytest.raises(AccessDeniedError) as refused:
                call()
            assert refused.value.right is not None
            assert refused.value.right.startswith("s3:GetObject on arn:aws:s3:::ckpts/team/store/refs/")
    assert s3_users.state() == before

    s3_users.become("nolist")
    for args in (["check"], ["gc", "--grace", "0"], ["repair"]):
        result = CliRunner().invoke(app, ["--store", str(s3_users.root), *args])
        assert result.exit_code == EXIT_DENIED, (args, result.output)
        assert "s3:ListBucket" in result.output, (args, result.output)
    assert s3_users.state() == before

    with s3_users.open("admin") as store:  # the store itself was never at fault
        assert store.ops.check(read_data=True).ok


def test_a_writer_runs_a_mirror_and_only_an_admin_removes_one(pg_roles: dict[str, Any],
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    with as_role(monkeypatch, pg_roles, "admin") as admin:
        admin.commit(state(1), run="r", step=1)
        admin.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_every=1)
    with as_role(monkeypatch, pg_roles, "writer") as writer:  # cron runs as the writer
        writer.commit(state(2), run="r", step=2)
        assert [v.status for v in writer.mirrors.push("m").versions] == ["sent", "sent"]
        assert [v.status for v in writer.mirrors.push("m").versions] == ["present", "present"]
        assert writer.mirrors.get("m").versions_sent == 2 and writer.mirrors.get("m").last_error is None
        with pytest.raises(AccessDeniedError):
            writer.mirrors.remove("m")
    with as_role(monkeypatch, pg_roles, "admin") as admin:
        admin.mirrors.remove("m")
        assert admin.mirrors.list() == []
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert torch.equal(dst.restore("r@2")["w"], state(2)["w"])


def test_a_writer_run_retires_a_failure_no_longer_selected(pg_roles: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "dst") as dst:  # run r is a line of its own there: r's versions fail
        dst.commit({"w": torch.zeros(4)}, run="r", step=2)
    with as_role(monkeypatch, pg_roles, "admin") as admin:
        for step in (1, 2):
            admin.commit(state(step), run="r", step=step)
        admin.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_every=1)
    with as_role(monkeypatch, pg_roles, "writer") as writer:  # its UPDATE of mirror_versions
        assert [v.status for v in writer.mirrors.push("m").versions] == ["failed", "failed"]
        writer.delete("r@1")
        assert [v.status for v in writer.mirrors.push("m").versions] == ["failed"]
        assert [f.step for f in writer.mirrors.get("m").failed] == [2]


def test_a_writer_granted_before_the_rekey_map_commits_and_copies_across_keys_with_a_warning(
        pg_roles: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    engine = sa.create_engine(pg_roles["owner_url"])  # as if granted before migration 0018
    with engine.begin() as conn:
        conn.exec_driver_sql(f"REVOKE ALL ON rekey_map FROM {pg_roles['names']['writer']}")
    engine.dispose()
    casckpt.generate_key_file(tmp_path / "k")
    with casckpt.open(tmp_path / "enc", key_file=tmp_path / "k") as enc:  # another chunk-id key
        enc.commit(state(1), run="r", step=1)
        with caplog.at_level(logging.WARNING), as_role(monkeypatch, pg_roles, "writer") as writer:
            writer.commit(state(2), run="w", step=2)  # not opened read-only
            assert [v.sent for v in enc.copy("r@1", to=writer).versions] == [True]
            assert torch.equal(writer.restore("r@1")["w"], state(1)["w"])
    assert any("--print-grants writer" in r.getMessage() and "rekey_map" in r.getMessage()
               for r in caplog.records)


def test_a_writer_granted_before_mirror_tags_commits_and_its_mirror_run_says_to_grant(
        pg_roles: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    engine = sa.create_engine(pg_roles["owner_url"])  # as if granted before migration 0019
    with engine.begin() as conn:
        conn.exec_driver_sql(f"REVOKE ALL ON mirror_tags FROM {pg_roles['names']['writer']}")
    engine.dispose()
    with as_role(monkeypatch, pg_roles, "admin") as admin:
        admin.mirrors.add("m", str(tmp_path / "dst"), runs=["r"], keep_every=1)
    with as_role(monkeypatch, pg_roles, "writer") as writer:
        assert not writer.read_only
        writer.commit(state(1), run="r", step=1)  # commits as before
        with pytest.raises(AccessDeniedError, match="--print-grants"):
            writer.mirrors.push("m")
        with pytest.raises(AccessDeniedError, match="--print-grants"):
            writer.mirrors.push("m", dry_run=True)
    assert not (tmp_path / "dst").exists()  # nothing was sent, no destination made
