"""register_tensors / reg_mrs: many regions in one call, each usable for a WRITE; a bad entry
registers nothing."""

import re

import numpy as np
import pytest
import torch

import fabric_lib as fl


def engine():
    return fl.TransferEngine(provider="tcp;ofi_rxm", nics=["127.0.0.1"])


def registered(e):
    """fabric_registrations_total of e's metrics_text()."""
    return float(re.search(r"\nfabric_registrations_total (\S+)\n", e.metrics_text()).group(1))


def test_register_tensors_registers_each_in_order_and_each_takes_writes():
    with engine() as tx, engine() as rx:
        srcs = [np.random.default_rng(i).integers(0, 256, 4096 * (i + 1), dtype=np.uint8) for i in range(3)]
        srcs.append(torch.arange(1000, dtype=torch.int32))
        dsts = [np.zeros(s.nbytes if isinstance(s, np.ndarray) else s.numel() * 4, np.uint8) for s in srcs]
        src_regs = tx.register_tensors(srcs)
        dst_regs = rx.register_tensors(dsts, prefault=True)
        assert len(src_regs) == len(dst_regs) == 4
        assert registered(rx) == 4
        for i, ((hs, _), (_, dd), dst) in enumerate(zip(src_regs, dst_regs, dsts)):
            assert dd.len == dst.nbytes
            sent, landed = fl.DoneFlag(), fl.DoneFlag()
            rx.expect_imm_count(10 + i, 1, landed)
            tx.submit_single_write(len=dst.nbytes, src=hs, dst=dd, on_done=sent, imm=10 + i)
            assert sent.wait(60) and sent.ok and landed.wait(60) and landed.ok
            want = srcs[i] if isinstance(srcs[i], np.ndarray) else srcs[i].numpy().view(np.uint8)
            assert np.array_equal(dst, want)
        for h, _ in src_regs:
            tx.dereg_mr(h)
        for h, _ in dst_regs:
            rx.dereg_mr(h)
        assert tx._registered == {} and rx._registered == {}


def test_a_bad_entry_registers_nothing():
    with engine() as e:
        good = np.zeros(8192, np.uint8)
        with pytest.raises(fl.FabricError, match=r"reg_mrs: region 1 of 2: pointer must be non-null"):
            e.reg_mrs([(good.ctypes.data, good.nbytes), (0, 4096)])
        with pytest.raises(ValueError, match="empty"):
            e.register_tensors([good, bytearray()])
        with pytest.raises(TypeError, match=r"region 0 must be a tuple"):
            e.reg_mrs([good.ctypes.data])
        assert registered(e) == 0
        assert e._registered == {}
        # The good buffer alone registers (nothing of it was left behind).
        (h, d), = e.reg_mrs([(good.ctypes.data, good.nbytes)])
        assert d.len == good.nbytes
        e.dereg_mr(h)
