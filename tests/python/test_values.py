"""Addresses, descriptors, page lists and buffer registration: conversions and bad input."""

import pickle

import numpy as np
import pytest
import torch

import fabric_lib as fl


@pytest.fixture
def engine():
    with fl.TransferEngine() as e:
        yield e


def test_address_and_descriptor_round_trips(engine):
    addr = engine.main_address()
    assert fl.NetAddr.from_bytes(addr.to_bytes()) == addr
    assert fl.NetAddr.from_hex(addr.to_hex()) == addr
    assert pickle.loads(pickle.dumps(addr)) == addr
    assert addr.provider == "tcp;ofi_rxm" and addr.nic_count == 1
    buf = np.zeros(4096, dtype=np.uint8)
    _, desc = engine.register_tensor(buf)
    assert fl.MrDesc.from_hex(desc.to_hex()) == desc
    assert pickle.loads(pickle.dumps(desc)) == desc
    assert desc.len == 4096 and desc.owner == addr


def test_malformed_bytes_raise(engine):
    raw = engine.main_address().to_bytes()
    with pytest.raises(fl.FabricError, match="truncated"):
        fl.NetAddr.from_bytes(raw[:-1])
    with pytest.raises(fl.FabricError, match="malformed"):
        fl.MrDesc.from_bytes(raw)
    with pytest.raises(fl.FabricError, match="non-hex"):
        fl.NetAddr.from_hex("zz")


def test_pages_accept_any_integer_sequence():
    for indices in ([3, 1, 2], np.array([3, 1, 2], dtype=np.int64), torch.tensor([3, 1, 2])):
        p = fl.Pages(indices, stride=8192, offset=16)
        assert p.indices == [3, 1, 2] and p.stride == 8192 and p.offset == 16 and len(p) == 3


def test_pages_reject_bad_indices():
    with pytest.raises(TypeError, match="integers"):
        fl.Pages(np.array([1.0, 2.0]), 4096)
    with pytest.raises(TypeError, match="integers"):
        fl.Pages(torch.tensor([1.5]), 4096)
    with pytest.raises(ValueError, match="one-dimensional"):
        fl.Pages(np.zeros((2, 2), dtype=np.int32), 4096)
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        fl.Pages([-1], 4096)


def test_register_rejects_what_cannot_be_written(engine):
    t = torch.zeros(16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="not contiguous"):
        engine.register_tensor(t.t())
    ro = np.zeros(16, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        engine.register_tensor(ro)
    with pytest.raises(ValueError, match="read-only"):
        engine.register_tensor(b"immutable bytes")
    with pytest.raises(fl.FabricError, match="length > 0"):
        engine.reg_mr(0, 0)


def test_registered_objects_stay_alive_until_deregistered(engine):
    h, _ = engine.register_tensor(torch.ones(1024))  # no other reference is kept
    assert h in engine._registered
    engine.dereg_mr(h)
    assert h not in engine._registered
    with pytest.raises(fl.FabricError, match="deregistered"):
        engine.dereg_mr(h)


def test_imm_count_rule_is_exposed():
    assert fl.single_write_imm_count(0, 4) == 1
    assert fl.single_write_imm_count(1 << 20, 4) == 4
    assert fl.single_write_imm_count(1 << 20, 4, True) == 1
    assert fl.single_write_imm_count(1 << 20, 4, num_shards=3) == 3  # an explicit shard count wins
    assert fl.single_write_imm_count(16, 4, True, num_shards=7) == 7


def test_text_fields_that_are_not_utf8_raise_fabric_error(engine):
    """A provider name or local endpoint that is not UTF-8 used to parse, and then every error
    naming it (and `provider`) raised UnicodeDecodeError. The parsers now refuse it."""
    addr = engine.main_address().to_bytes()
    _, desc = engine.register_tensor(np.zeros(64, dtype=np.uint8))
    d = desc.to_bytes()
    # The provider name starts at byte 6 of a NetAddr ("FBNA", version, length), and the owner's
    # NetAddr at byte 9 of an MrDesc ("FBMD", version, u32 length).
    for bad in (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"):
        a = addr[:6] + bad + addr[6 + len(bad):]
        with pytest.raises(fl.FabricError, match="malformed: NetAddr: field 'provider' is not valid UTF-8"):
            fl.NetAddr.from_bytes(a)
        with pytest.raises(fl.FabricError, match="'provider' is not valid UTF-8"):
            fl.NetAddr.from_hex(a.hex())
        with pytest.raises(fl.FabricError, match="'provider' is not valid UTF-8"):
            fl.MrDesc.from_bytes(d[:9] + a + d[9 + len(a):])
    # Multi-byte UTF-8 is fine, and the NIC addresses stay binary (sockaddr bytes).
    a = addr[:6] + "é".encode() + addr[8:]
    assert fl.NetAddr.from_bytes(a).provider == "é" + "tcp;ofi_rxm"[2:]
    assert fl.NetAddr.from_bytes(addr) == engine.main_address()

