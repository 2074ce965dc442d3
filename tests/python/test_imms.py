"""Immediate namespaces from Python: a reservation's range, overlaps refused naming the holder,
WRITEs into a region registered under it counted there as local values, and the engine's raw
calls refusing its values."""

import numpy as np
import pytest

import fabric_lib as fl


def test_reservations_are_disjoint_and_an_overlap_names_its_holder():
    with fl.TransferEngine() as e:
        kv = e.reserve_imms("kv receiver")
        moe = e.reserve_imms("moe", bits=28)
        assert (kv.base, kv.bits, kv.holder) == (0xF0000000, 28, "kv receiver")
        assert moe.base == 0xE0000000
        with pytest.raises(fl.FabricError, match="held by 'kv receiver'"):
            e.reserve_imms("late", bits=27, base=0xF8000000)
        with pytest.raises(fl.FabricError, match="not a multiple"):
            e.reserve_imms("odd", bits=8, base=3)
        assert kv.imm(5) == 0xF0000005
        with pytest.raises(fl.FabricError, match="does not fit"):
            kv.imm(1 << 28)
        with pytest.raises(fl.FabricError, match="'moe'"):
            e.expect_imm_count(moe.imm(1), 1, fl.DoneFlag())
        kv.release()
        assert not kv.held
        with pytest.raises(fl.FabricError, match="not held"):
            kv.count(1)
        assert e.reserve_imms("again").base == 0xF0000000


@pytest.mark.parametrize("provider", ["tcp;ofi_rxm", "shm"])
def test_writes_into_a_reserved_region_are_counted_in_its_range(provider):
    nics = [""] if provider == "shm" else ["127.0.0.1"]
    with fl.TransferEngine(provider=provider, nics=nics) as a, fl.TransferEngine(provider=provider, nics=nics) as b:
        r = b.reserve_imms("b's user", bits=8)
        src = np.arange(4096, dtype=np.uint8)
        dst, raw = np.zeros(4096, np.uint8), np.zeros(4096, np.uint8)
        hs, _ = a.register_tensor(src)
        _, dd = b.register_tensor(dst, imms=r)
        _, dw = b.register_tensor(raw)
        assert (dd.imm_base, dd.imm_bits) == (r.base, 8) and dw.imm_bits == 32
        landed, raw_landed = fl.DoneFlag(), fl.DoneFlag()
        r.expect(7, 1, landed, timeout_s=30)
        b.expect_imm_count(7, 1, raw_landed, timeout_s=30)
        a.submit_single_write(len=64, src=hs, dst=dd, imm=7)
        a.submit_single_write(len=64, src=hs, dst=dw, imm=7)
        assert landed.wait(30) and landed.ok and raw_landed.wait(30) and raw_landed.ok
        assert (dst[:64] == src[:64]).all() and (raw[:64] == src[:64]).all()
        with pytest.raises(fl.FabricError, match="does not fit the 8-bit"):
            a.submit_single_write(len=64, src=hs, dst=dd, imm=256)
        assert r.count(0) == 0 and r.discard(7) == 0
