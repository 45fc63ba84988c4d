"""A table file whose disk fills up (or refuses writes) mid-training: the error names the file, the operation and
the intact snapshot; the table refuses every later use; close() releases the file and its lock, saying what is
lost; the same process reopens it with recover=True once space is back and gets the committed snapshot bit for bit;
exit-time finalizers print nothing after the error reached the caller.

Each case runs in a child process on a real small filesystem: a 12 MiB tmpfs where the tests may mount one
(root), and everywhere a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail with EFBIG)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

CHILD = textwrap.dedent(r"""
    import errno, fcntl, os, resource, signal, sys, warnings
    import torch
    import cachedemb
    from cachedemb import optim
    from cachedemb.storage.format import TableIOError, TableWriterDiedError, UncommittedRowsLostWarning

    kind, folder, log, close = sys.argv[1], sys.argv[2], sys.argv[3] == "log", sys.argv[4] == "close"
    path = os.path.join(folder, "t.cemb")
    N, D = 20000, 16
    spec = optim.Adagrad(lr=0.1)
    record = 2 * D * 4 + 8
    torch.manual_seed(0)
    weight = torch.randn(N, D)

    def ours(reopen=False, recover=False):
        return cachedemb.CachedEmbeddingBag(N, D, cache_ratio=0.1, optimizer=spec, _weight=None if reopen else
                                            weight.clone(), storage=cachedemb.FileStorage(
                                                path, host_cache_bytes=N * record // 16 + 4 * N, log=log,
                                                recover=recover))

    def step(m, k):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, N, (1024,), generator=g)
        out = m(ids, torch.arange(0, 1024, 8))
        (out * torch.randn(out.shape, generator=g)).sum().backward()
        return out.detach()

    ref = cachedemb.CachedEmbeddingBag(N, D, cache_ratio=0.1, optimizer=spec, _weight=weight.clone())
    m = ours()
    for k in range(3):
        assert torch.equal(step(ref, k), step(m, k))
    seq = m.commit()
    print("committed", seq, flush=True)
    want = {key: v.clone() for key, v in ref.state_dict().items()}

    filler = os.path.join(folder, "filler")
    if kind == "fsize":  # the file may not grow: its first new block (copy-on-write, or a log append) fails
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), resource.RLIM_INFINITY))
    else:  # fill the tmpfs
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (64 << 10))
                    f.flush()
            except OSError:
                pass
    failed = None
    for k in range(3, 60):
        try:
            step(m, k)
        except TableIOError as error:
            failed = error
            break
    assert failed is not None, "the disk never filled"
    assert failed.errno in (errno.ENOSPC, errno.EFBIG), failed.errno
    text = str(failed)
    assert path in text and f"snapshot {seq}" in text and "recover=True" in text, text
    assert failed.operation in ("write-back", "cleaning", "commit", "read"), failed.operation
    print("failed at", failed.operation, errno.errorcode[failed.errno])
    for again in (lambda: step(m, 99), m.commit, m.flush):  # the table refuses every later use
        try:
            again()
        except TableIOError:
            pass
        else:
            raise AssertionError("a table whose write failed was used again")
    if not close:
        sys.exit(0)  # exit-time finalizers run now: they must print nothing
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.close()  # releases the file and its lock, saying what is lost
    assert [w.category for w in seen] == [UncommittedRowsLostWarning], [str(w.message) for w in seen]
    assert f"snapshot {seq}" in str(seen[0].message)
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody holds it
    os.close(fd)
    if kind == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    else:
        os.remove(filler)
    try:
        ours(reopen=True)
    except TableWriterDiedError as error:
        assert "recover=True" in str(error)
    else:
        raise AssertionError("a file released after an I/O error opened without recover=True")
    back = ours(reopen=True, recover=True)
    got = back.export_state_dict()
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    for k in range(3, 6):  # and trains on from there as the in-memory table does
        assert torch.equal(step(ref, k), step(back, k))
    back.close()
    print("recovered snapshot", seq)
""")


def run_child(kind: str, folder, log: bool, close: bool):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("CACHEDEMB_STORAGE_LOG", None)
    return subprocess.run([sys.executable, "-c", CHILD, kind, str(folder), "log" if log else "in_place",
                           "close" if close else "exit"], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def small_disk(tmp_path, request):
    """A folder on a real filesystem that fills: a 12 MiB tmpfs ("tmpfs", needs mount rights) or any folder with
    the child's file-size limit ("fsize")."""
    if request.param == "fsize":
        yield "fsize", tmp_path
        return
    folder = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}); the file-size "
                    "limit case covers the same paths")
    try:
        yield "tmpfs", folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.parametrize("small_disk", ["fsize", "tmpfs"], indirect=True)
@pytest.mark.parametrize("log", [False, True], ids=["in_place", "log"])
def test_a_full_disk_keeps_the_snapshot_and_releases_the_file(small_disk, log):
    kind, folder = small_disk
    done = run_child(kind, folder, log, close=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "recovered snapshot" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("small_disk", ["fsize"], indirect=True)
def test_exit_after_the_error_prints_nothing_and_the_snapshot_recovers(small_disk):
    kind, folder = small_disk
    done = run_child(kind, folder, False, close=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "", done.stderr  # no finalizer raised the error again at exit
    reopen = textwrap.dedent(f"""
        import cachedemb
        from cachedemb.storage.table_file import open_table
        table = open_table({str(folder / 't.cemb')!r}, recover=True)
        print(table.newest_seq)
        table.close()
    """)
    committed = done.stdout.split("committed ")[1].split()[0]
    seq = subprocess.run([sys.executable, "-c", reopen], capture_output=True, text=True, timeout=120)
    assert seq.returncode == 0, seq.stderr
    assert seq.stdout.split() == [committed], (seq.stdout, done.stdout)
