"""Python GPU signals and KV transfer with torch CUDA tensors (run by tests/gpu/run.sh on the GPU
machine; skipped where torch has no CUDA). Prints the Python watcher's latency:
`python-watcher p50_us=... mean_us=... p99_us=...` (a torch kernel's store launched from Python, to
the callback that saw it having woken the launching thread) and `python-watcher-wait p50_us=...`
(to engine.wait_uvm_watcher returning)."""

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("torch sees no CUDA device", allow_module_level=True)

import fabric_lib as fl  # noqa: E402
from fabric_lib import kv  # noqa: E402


class _Word:
    """A one-element int64 view of device-mapped memory at `ptr`, for torch kernels."""

    def __init__(self, ptr):
        self.__cuda_array_interface__ = {"shape": (1,), "typestr": "<i8", "data": (ptr, False), "version": 3}


def _word(ptr):
    return torch.as_tensor(_Word(ptr), device="cuda")


def _engine():
    return fl.TransferEngine(cuda_device=0, cuda_ipc=True)


def test_a_watcher_calls_python_on_each_store_of_a_torch_kernel():
    n = 2000
    with _engine() as e:
        seen, lat = [], []
        ev = threading.Event()

        def cb(old, new):
            seen.append((old, new))
            ev.set()

        w = e.alloc_uvm_watcher(cb)
        word = _word(w.device_ptr)
        for i in range(1, n + 1):
            ev.clear()
            t0 = time.perf_counter_ns()
            word.fill_(i)
            assert ev.wait(5), f"store {i} not seen"
            lat.append((time.perf_counter_ns() - t0) / 1000)
        e.free_uvm_watcher(w)
        assert seen[-1][1] == n and all(a < b for a, b in seen)
        lat = np.array(lat[100:])  # after warm-up
        print(f"\npython-watcher p50_us={np.percentile(lat, 50):.2f} mean_us={lat.mean():.2f} "
              f"p99_us={np.percentile(lat, 99):.2f} (n={lat.size})")


def test_wait_uvm_watcher_returns_the_stored_value_and_times_out_clearly():
    with _engine() as e:
        w = e.alloc_uvm_watcher()  # no callback: only the waits read the word
        word = _word(w.device_ptr)
        word.fill_(5)
        assert e.wait_uvm_watcher(w, 5, 5) == 5
        assert e.wait_uvm_watcher(w, 3, 0) == 5, "a value already past at_least is returned at once"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="reads 5, not yet 6"):
            e.wait_uvm_watcher(w, 6, 0.1)
        assert 0.1 <= time.monotonic() - t0 < 5
        # Another thread launches the store while this one waits (the GIL is released meanwhile).
        timer = threading.Timer(0.05, lambda: word.fill_(9))
        timer.start()
        assert e.wait_uvm_watcher(w, 7, 10) == 9
        timer.join()
        lat = []
        for i in range(10, 1010):
            t0 = time.perf_counter_ns()
            word.fill_(i)
            assert e.wait_uvm_watcher(w, i, 5) == i
            lat.append((time.perf_counter_ns() - t0) / 1000)
        e.free_uvm_watcher(w)
        lat = np.array(lat[100:])
        print(f"\npython-watcher-wait p50_us={np.percentile(lat, 50):.2f} p99_us={np.percentile(lat, 99):.2f} "
              f"(launch -> wait_uvm_watcher returned, n={lat.size})")


def test_wait_gpu_counter_sees_completions_times_out_and_ends_at_close():
    with _engine() as a, _engine() as b:
        src = torch.ones(1 << 16, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)
        counter = b.alloc_gpu_counter()
        for _ in range(3):
            b.expect_imm_count(8, 1, counter)
        with pytest.raises(TimeoutError, match="wait_gpu_counter: the word reads 0, not yet 1"):
            b.wait_gpu_counter(counter, 1, 0.05)
        writes = threading.Timer(0.05, lambda: [a.submit_single_write(len=1 << 16, src=hs, dst=dd, imm=8,
                                                                      num_shards=1) for _ in range(3)])
        writes.start()
        assert b.wait_gpu_counter(counter, 3, 30) == 3
        writes.join()
        assert bool((dst == 1).all())
        # A wait with no limit ends when the engine closes (its words go with it).
        ended = []

        def waiter():
            try:
                b.wait_gpu_counter(counter, 100)
            except fl.FabricError as err:
                ended.append(str(err))

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.1)
        assert t.is_alive()
        b.close()
        t.join(10)
        assert not t.is_alive() and ended and "closed while waiting" in ended[0], ended


def test_a_gpu_counter_counts_completions_and_a_stream_waits_on_it():
    with _engine() as a, _engine() as b:
        src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst)
        counter = b.alloc_gpu_counter()
        b.expect_imm_count(7, 1, counter)  # counts one success
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dst.to(torch.int64).sum()  # warm the allocator: no cudaMalloc (an implicit sync) later
        stream.synchronize()
        # A stream blocked on the counter must never meet an implicit device sync before the
        # write lands (that sync would wait for it forever): the write comes from another thread.
        writer = threading.Thread(target=lambda: (time.sleep(0.05), a.submit_single_write(
            len=1 << 20, src=hs, dst=dd, imm=7, num_shards=1)))
        fl.gpu_stream_wait(stream.cuda_stream, counter, 1)
        with torch.cuda.stream(stream):
            total = dst.to(torch.int64).sum()  # queued behind the wait
        writer.start()
        writer.join(30)
        stream.synchronize()
        assert counter.value == 1
        assert int(total) == int(src.to(torch.int64).sum())
        b.free_gpu_counter(counter)


def test_kv_layers_triggered_by_torch_kernels_land_in_the_decode_tensors():
    layers, pages, page_tokens, heads, head_dim = 4, 32, 16, 2, 64
    lay = kv.make_layout(num_layers=layers, num_pages=pages, page_tokens=page_tokens, kv_heads=heads,
                         head_dim=head_dim)
    shape = (pages, page_tokens, heads, head_dim)
    with _engine() as pe, _engine() as de:
        pk = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        pv = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        dk = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        dv = [torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
        rx = kv.KvReceiver(de, lay, dk, dv, group=1, total_heads=heads)
        tx = kv.KvSender(pe, lay, pk, pv, group=2, total_heads=heads)
        tx.add_decoder(rx.descriptor())
        landed = de.alloc_gpu_counter()
        done = threading.Event()
        status = []
        src, dst = list(range(0, 20)), list(range(31, 11, -1))
        msg = rx.admit(5, dst, landed=landed, on_done=lambda s: (status.append(s), done.set()))
        tx.begin(msg, src)
        tx.begin_forward([5])
        trigger = _word(tx.gpu_trigger().device_ptr)
        for layer in range(layers):  # the "model": write the layer's pages, then bump the trigger
            pk[layer][src] = float(layer + 1)
            pv[layer][src] = float(-(layer + 1))
            trigger.add_(1)
        trigger.add_(1)  # the forward's last step (no extras here)
        assert done.wait(30) and status[0].ok, status
        assert landed.value == layers
        for layer in range(layers):
            assert bool((dk[layer][dst] == layer + 1).all()) and bool((dv[layer][dst] == -(layer + 1)).all())
            untouched = [p for p in range(pages) if p not in dst]
            assert bool((dk[layer][untouched] == 0).all())
        de.free_gpu_counter(landed)
