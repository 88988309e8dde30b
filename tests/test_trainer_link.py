"""The sidecar's side of the trainer's socket (dgt.trainer_link), over a real Unix
socket: a bug of ours while serving the trainer fails the job in one line and leaves its
traceback in the sidecar's log."""
import asyncio
import logging

from dgt.trainer_link import TrainerLink


def test_a_bug_of_ours_serving_the_trainer_fails_the_job_and_logs_its_traceback(
        tmp_path, caplog):
    """Breaker round 12's IndexError left only its one-line repr, in the failure record
    and the log: its traceback went to DEBUG, which no log keeps. It now goes to the
    sidecar's log at ERROR, before the one line that fails the job."""
    failed = []

    async def broken(msg):
        [][0]   # what round 12 hit: list index out of range

    async def main():
        done = asyncio.Event()

        def fail(message, rank, **kw):
            failed.append((message, rank))
            done.set()

        link = TrainerLink(0, {"register": broken}, fail, lambda: None, done)
        path = str(tmp_path / "s.sock")
        server = await asyncio.start_unix_server(link.serve, path)
        try:
            _, w = await asyncio.open_unix_connection(path)
            w.write(b'{"op": "register", "n_params": 10}\n')
            await w.drain()
            await asyncio.wait_for(done.wait(), 30)
            w.close()
        finally:
            server.close()

    with caplog.at_level(logging.DEBUG, logger="dgt.sidecar"):
        asyncio.run(main())
    assert failed == [("rank 0: internal error: IndexError('list index out of range')", 0)]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and r.exc_info]
    assert len(errors) == 1, caplog.records
    assert errors[0].exc_info[0] is IndexError
    assert "internal error; please report this traceback" in errors[0].getMessage()
