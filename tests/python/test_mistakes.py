"""The mistakes a new user makes, one by one: each raises the exact exception type, its message
names what to change, no byte moves and nothing crashes (issue 47, item 5)."""

import asyncio

import numpy as np
import pytest

import fabric_lib as fl

from roles import wait_for

N = 4096


@pytest.fixture
def pair():
    """Two engines on loopback: a sender with a source full of 7s and a receiver whose destination
    is all zeros (every test checks it stays so when a call is refused)."""
    with fl.TransferEngine() as tx, fl.TransferEngine() as rx:
        src, dst = np.full(N, 7, np.uint8), np.zeros(N, np.uint8)
        hs, _ = tx.register_tensor(src)
        hd, dd = rx.register_tensor(dst)
        yield tx, rx, hs, dd, dst


def refused(exc_type, fragments, call):
    """call() raises exc_type, and its message holds every fragment (what was wrong, what to do)."""
    with pytest.raises(exc_type) as info:
        call()
    for f in fragments:
        assert f in str(info.value), f"{str(info.value)!r} lacks {f!r}"
    return info.value


def landed(rx, imm):
    """A flag the receiver sets once `imm` arrived: the data of a WRITE is in place then (the
    sender's on_done says only that its WRITEs completed locally)."""
    flag = fl.DoneFlag()
    rx.expect_imm_count(imm, 1, flag)
    return flag


def test_a_handle_of_another_engine(pair):
    tx, rx, hs, dd, dst = pair
    with fl.TransferEngine() as other:
        e = refused(fl.FabricError, ["belongs to engine", "its own reg_mr"],
                    lambda: other.submit_single_write(len=N, src=hs, dst=dd))
        assert e.code == "invalid argument"
        remote = tx.add_remote(dd)
        refused(fl.FabricError, ["RemoteMr belongs to engine", "add_remote"],
                lambda: other.submit_single_write(len=N, src=other.register_tensor(np.zeros(N, np.uint8))[0],
                                                  dst=remote))
    assert not dst.any()


def test_a_fired_flag_given_again(pair):
    tx, rx, hs, dd, dst = pair
    flag, first = fl.DoneFlag(), landed(rx, 50)
    tx.submit_single_write(len=16, src=hs, dst=dd, on_done=flag, imm=50)
    assert flag.wait(30) and flag.status.ok and first.wait(30)
    e = refused(fl.FabricError, ["already fired", "reset()"],
                lambda: tx.submit_single_write(len=N, src=hs, dst=dd, on_done=flag))
    assert e.code == "invalid argument"
    assert (dst[:16] == 7).all() and not dst[16:].any()
    flag.reset()  # the explicit re-arm
    assert repr(flag) == "DoneFlag(unused)"
    second = landed(rx, 51)
    tx.submit_single_write(len=N, src=hs, dst=dd, on_done=flag, imm=51)
    assert flag.wait(30) and flag.ok and second.wait(30) and (dst == 7).all()


def test_a_flag_still_in_flight_given_again(pair):
    tx, rx, hs, dd, dst = pair
    flag = fl.DoneFlag()
    rx.expect_imm_count(41, 1, flag)  # pending until 41 arrives
    refused(fl.FabricError, ["still waiting"], lambda: tx.submit_single_write(len=N, src=hs, dst=dd, on_done=flag))
    refused(fl.FabricError, ["has not ended"], flag.reset)
    assert not dst.any()
    tx.submit_barrier(dsts=[dd], imm=41)
    assert flag.wait(30) and flag.ok


def test_a_cancelled_await_leaves_no_expectation(pair):
    tx, rx, hs, dd, dst = pair

    async def run():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rx.imm_count_reached(42, 1), 0.05)
        tx.submit_barrier(dsts=[dd], imm=42)
        await rx.imm_count_reached(42, 1, timeout_s=30)  # the arrival is this await's, not eaten

    asyncio.run(run())
    assert rx.imm_count(42) == 0


def test_a_registration_longer_than_its_memory(pair):
    tx, rx, hs, dd, dst = pair
    small = np.zeros(1 << 20, np.uint8)
    e = refused(fl.FabricError, ["not mapped memory in full", "real length"],
                lambda: rx.reg_mr(small.ctypes.data, 1 << 40))
    assert e.code == "invalid argument"


@pytest.mark.parametrize("imm", [-1, 2**32])
def test_an_immediate_out_of_range(pair, imm):
    tx, rx, hs, dd, dst = pair
    refused(ValueError, ["imm must be in [0, 2**32)", str(imm)],
            lambda: tx.submit_single_write(len=N, src=hs, dst=dd, imm=imm))
    refused(ValueError, ["expect_imm_count()", "imm"], lambda: rx.expect_imm_count(imm, 1))
    assert not dst.any()


def test_a_negative_length(pair):
    tx, rx, hs, dd, dst = pair
    refused(ValueError, ["len must be in [0, 2**64)", "-5"], lambda: tx.submit_single_write(len=-5, src=hs, dst=dd))
    refused(ValueError, ["page_len"], lambda: tx.submit_paged_writes(
        page_len=-1, src=hs, src_pages=fl.Pages([0], 16), dst=dd, dst_pages=fl.Pages([0], 16)))
    assert not dst.any()


def test_positional_arguments(pair):
    tx, rx, hs, dd, dst = pair
    refused(TypeError, ["keyword arguments only", "len, src, dst"], lambda: tx.submit_single_write(N, hs, dd))
    assert not dst.any()


def test_an_unknown_or_missing_argument(pair):
    tx, rx, hs, dd, dst = pair
    refused(TypeError, ["unknown argument 'length'"], lambda: tx.submit_single_write(length=N, src=hs, dst=dd))
    refused(TypeError, ["missing the argument len"], lambda: tx.submit_single_write(src=hs, dst=dd))
    assert not dst.any()


def test_arguments_of_the_wrong_type(pair):
    tx, rx, hs, dd, dst = pair
    refused(TypeError, ["src must be an MrHandle"], lambda: tx.submit_single_write(len=N, src=dd, dst=dd))
    refused(TypeError, ["dst must be a RemoteMr", "MrDesc"], lambda: tx.submit_single_write(len=N, src=hs, dst=hs))
    refused(TypeError, ["on_done must be None", "DoneFlag"],
            lambda: tx.submit_single_write(len=N, src=hs, dst=dd, on_done=5))
    refused(TypeError, ["len must be an int"], lambda: tx.submit_single_write(len=1.5, src=hs, dst=dd))
    assert not dst.any()


def test_numpy_integers_are_not_mistakes(pair):
    tx, rx, hs, dd, dst = pair
    flag, there = fl.DoneFlag(), landed(rx, 5)
    tx.submit_single_write(len=np.uint64(N), src=hs, dst=dd, imm=np.int32(5), on_done=flag)
    assert flag.wait(30) and flag.ok and there.wait(30) and (dst == 7).all()


def test_value_types_built_wrong(pair):
    """Pages, ScatterSlice and GroupSlice name the argument that is wrong; Pages takes any iterable
    of ints (a list, an int64 array) and checks each index."""
    tx, rx, hs, dd, dst = pair
    assert list(fl.Pages([3, 1], stride=4096).indices) == [3, 1]
    assert list(fl.Pages(np.array([2, 0], np.int64), 4096, offset=np.uint64(8)).indices) == [2, 0]
    refused(ValueError, ["[0, 2**32)", "indices[1] is -1"], lambda: fl.Pages([0, -1], 4096))
    refused(TypeError, ["page indices must be integers"], lambda: fl.Pages([0.5], 4096))
    refused(ValueError, ["Pages()", "stride must be in [0, 2**64)"], lambda: fl.Pages([0], -4096))
    refused(TypeError, ["Pages()", "offset must be an int"], lambda: fl.Pages([0], 4096, offset="8"))
    refused(ValueError, ["Pages()", "indices[1] must be in [0, 2**32)"], lambda: fl._c.Pages([0, 2**32], 4096))
    assert fl.ScatterSlice(np.int64(16), 0, dd).len == 16
    refused(TypeError, ["ScatterSlice.dst must be a RemoteMr", "got fabric_lib._fabric_lib.MrHandle"], lambda: fl.ScatterSlice(16, 0, hs))
    refused(ValueError, ["ScatterSlice()", "len must be in [0, 2**64)"], lambda: fl.ScatterSlice(-16, 0, dd))
    assert fl.GroupSlice(np.uint32(8), 0, 0).len == 8
    refused(TypeError, ["GroupSlice()", "unknown argument 'length'"], lambda: fl.GroupSlice(length=8, src_offset=0, dst_offset=0))


def test_gpu_signal_calls_built_wrong(pair):
    """The GPU-signal calls name what is wrong before touching CUDA (the checks run without a GPU)."""
    tx, rx, hs, dd, dst = pair
    refused(TypeError, ["wait_gpu_counter()", "counter must be a GpuCounter"],
            lambda: tx.wait_gpu_counter(hs, 1))
    refused(TypeError, ["wait_uvm_watcher()", "watcher must be a UvmWatcher"], lambda: tx.wait_uvm_watcher(dd, 1))
    refused(TypeError, ["alloc_uvm_watcher()", "callback must be callable"], lambda: tx.alloc_uvm_watcher(callback=5))
    refused(TypeError, ["alloc_gpu_counter()", "cuda_device must be an int"], lambda: tx.alloc_gpu_counter(cuda_device="0"))
    refused(TypeError, ["gpu_stream_wait()", "cuda_stream must be an int"], lambda: fl.gpu_stream_wait("s", hs, 1))


def test_a_write_out_of_bounds(pair):
    tx, rx, hs, dd, dst = pair
    e = refused(fl.FabricError, ["destination", "outside the remote region"],
                lambda: tx.submit_single_write(len=16, src=hs, dst=dd, dst_offset=N - 8))
    assert e.code == "out of bounds"
    assert not dst.any()


def test_a_handle_after_dereg(pair):
    tx, rx, hs, dd, dst = pair
    tx.dereg_mr(hs)
    e = refused(fl.FabricError, ["deregistered MrHandle", "not after dereg_mr"],
                lambda: tx.submit_single_write(len=N, src=hs, dst=dd))
    assert e.code == "not found"
    assert not dst.any()


def test_calls_after_close(pair):
    tx, rx, hs, dd, dst = pair
    tx.close()
    e = refused(fl.FabricError, ["closed"], lambda: tx.submit_single_write(len=N, src=hs, dst=dd))
    assert e.code == "shutdown"
    assert not dst.any()


def test_an_empty_nic_list_and_a_bad_poll_mode():
    e = refused(fl.FabricError, ["1 to 4 NICs", "leave it out"], lambda: fl.TransferEngine(nics=[]))
    assert e.code == "invalid argument"
    refused(ValueError, ["'busy' or 'adaptive'"], lambda: fl.TransferEngine(poll="fast"))


def test_engine_arguments_named():
    refused(TypeError, ["nics=", "list of strings"], lambda: fl.TransferEngine(nics="127.0.0.1"))
    refused(TypeError, ["unknown argument 'nic'"], lambda: fl.TransferEngine(nic=["127.0.0.1"]))
    refused(ValueError, ["max_message_size", "positive int"], lambda: fl.TransferEngine(max_message_size=0))
    refused(TypeError, ["transfer_timeout_s", "number of seconds"], lambda: fl.TransferEngine(transfer_timeout_s="5"))


def test_shm_needs_no_address():
    with fl.TransferEngine(provider="shm") as e:
        assert e.main_address().provider == "shm"


def test_the_environment_is_honoured(monkeypatch):
    monkeypatch.setenv("FABRIC_PROVIDER", "shm")
    with fl.TransferEngine() as e:
        assert e.main_address().provider == "shm"
    monkeypatch.setenv("FABRIC_PROVIDER", "tcp;ofi_rxm")
    monkeypatch.setenv("FABRIC_NICS", "127.0.0.2,127.0.0.3")
    with fl.TransferEngine() as e:
        assert e.nic_count == 2


def test_a_timeout_is_one_type(pair):
    tx, rx, hs, dd, dst = pair
    flag = fl.DoneFlag()
    rx.expect_imm_count(43, 1, flag, timeout_s=0.02)
    assert flag.wait(30) and not flag.ok
    assert flag.status.code == "timeout" and "0x2b" in flag.status.message

    async def run():
        await rx.imm_count_reached(44, 1, timeout_s=0.02)

    e = refused(fl.FabricTimeoutError, ["immediate 0x2c"], lambda: asyncio.run(run()))
    assert isinstance(e, TimeoutError) and isinstance(e, fl.FabricError) and e.code == "timeout"


def test_mismatched_page_lists(pair):
    tx, rx, hs, dd, dst = pair
    refused(fl.FabricError, ["3 source pages but 2"], lambda: tx.submit_paged_writes(
        page_len=16, src=hs, src_pages=fl.Pages([0, 1, 2], 16), dst=dd, dst_pages=fl.Pages([0, 1], 16)))
    assert not dst.any()


def test_buffers_that_cannot_be_registered():
    with fl.TransferEngine() as e:
        refused(ValueError, ["not C-contiguous"], lambda: e.register_tensor(np.zeros((8, 8), np.uint8)[:, ::2]))
        ro = np.zeros(16, np.uint8)
        ro.flags.writeable = False
        refused(ValueError, ["read-only"], lambda: e.register_tensor(ro))


def test_a_message_longer_than_the_receiver_accepts():
    """The receiver's address carries its max_message_size (its receive buffers hold that much,
    whatever length submit_recvs was given): the sender refuses a longer message at submit, instead
    of the receiver dropping it."""
    with fl.TransferEngine(provider="shm") as tx, fl.TransferEngine(provider="shm", max_message_size=256) as rx:
        got = []
        rx.submit_recvs(64, 4, got.append)
        e = refused(fl.FabricError, ["longer than the peer accepts (256 bytes", "max_message_size"],
                    lambda: tx.submit_send(rx.main_address(), b"x" * 257))
        assert e.code == "invalid argument"
        sent = fl.DoneFlag()
        tx.submit_send(rx.main_address(), b"y" * 256, sent)
        assert sent.wait(30) and sent.ok
        assert wait_for(lambda: len(got) == 1) and got == [b"y" * 256]
        assert sum(s.messages_dropped for s in rx.nic_stats()) == 0
        refused(fl.FabricError, ["exceeds EngineConfig::max_message_size"],
                lambda: tx.submit_send(rx.main_address(), b"x" * 20000))


def test_a_write_to_a_closed_peer_ends_with_an_error():
    with fl.TransferEngine(transfer_timeout_s=5) as tx:
        rx = fl.TransferEngine()
        src, dst = np.full(N, 7, np.uint8), np.zeros(N, np.uint8)
        hs, _ = tx.register_tensor(src)
        _, dd = rx.register_tensor(dst)
        rx.close()
        flag = fl.DoneFlag()
        tx.submit_single_write(len=N, src=hs, dst=dd, on_done=flag)
        assert flag.wait(60), "a write to a dead peer must end"
        assert not flag.ok and flag.status.code in ("provider error", "timeout")


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_a_write_into_a_region_its_owner_deregistered(provider):
    """The owner deregistered the destination: the sender's flag ends with a provider error (shm:
    naming the deregistration), nothing lands and no immediate is counted."""
    with fl.TransferEngine(provider=provider) as tx, fl.TransferEngine(provider=provider) as rx:
        src, dst = np.full(1 << 16, 7, np.uint8), np.zeros(1 << 16, np.uint8)
        hs, _ = tx.register_tensor(src)
        hd, dd = rx.register_tensor(dst)
        remote = tx.add_remote(dd, connect=True)
        rx.dereg_mr(hd)
        flag = fl.DoneFlag()
        tx.submit_single_write(len=src.nbytes, src=hs, dst=remote, on_done=flag, imm=9)
        assert flag.wait(60), "a write into a deregistered region must end"
        assert not flag.ok and flag.status.code == "provider error", flag.status
        if provider == "shm":
            assert "deregistered by its owner" in flag.status.message
        assert not dst.any() and rx.imm_count(9) == 0
