"""Ports probed for listeners bound later stay out of the OS's ephemeral range, where another
process's outgoing connection could take them between the probe and the bind."""
import socket

from rlspec.refit import ports


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_probed_port_lies_below_the_ephemeral_range_and_binds():
    lo, hi = ports.ephemeral_range()
    assert lo > ports._PROBE_FLOOR, "this machine's ephemeral range leaves room below it"
    drawn = {ports.free_port() for _ in range(8)}
    assert all(ports._PROBE_FLOOR <= p < lo for p in drawn), (drawn, lo)
    assert all(_bindable(p) for p in drawn)


def test_a_port_in_use_is_not_drawn(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(ports, "_PROBE_FLOOR", taken)
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (taken + 2, 60999))
        # Two candidates, one held: a probe that did not check would draw it about half the time.
        drawn = {ports.free_port() for _ in range(8)}
        assert taken not in drawn
        assert all(_bindable(p) for p in drawn)


def test_no_room_below_the_range_falls_back_to_a_port_the_os_chooses(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (ports._PROBE_FLOOR, 60999))
    port = ports.free_port()
    assert _bindable(port)


def test_the_range_is_read_from_the_kernel_file_or_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(str(f)) == (40000, 50000)
    f.write_text("garbage\n")
    assert ports.ephemeral_range(str(f)) == (32768, 60999)
    assert ports.ephemeral_range(str(tmp_path / "absent")) == (32768, 60999)
