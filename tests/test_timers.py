"""Timers, cache flush and clocks: the replaceable parts."""

from __future__ import annotations

import os
import time

import pytest

from krex.errors import UnknownDevice
from krex.measure import cache, clocks, events
from krex.measure.timers import CpuTimer, FakeTimer, Timer, make_timer


def test_fake_timer_is_deterministic_and_virtual():
    a, b = FakeTimer(seed=5), FakeTimer(seed=5)
    ka, kb = a.kernel(2.0, noise_rel=0.1), b.kernel(2.0, noise_rel=0.1)
    times_a = [a.elapsed_ms(a.stop(_call(a.start(), ka))) for _ in range(50)]
    times_b = [b.elapsed_ms(b.stop(_call(b.start(), kb))) for _ in range(50)]
    assert times_a == times_b
    assert a.now_s() == pytest.approx((sum(times_a) + 100 * a.host_overhead_ms) / 1e3)


def _call(token, fn):
    fn()
    return token


def test_fake_timer_scripted_durations_cycle():
    t = FakeTimer()
    k = t.kernel(durations_ms=[1.0, 3.0])
    got = []
    for _ in range(4):
        start = t.start()
        k()
        got.append(t.elapsed_ms(t.stop(start)))
    assert got == pytest.approx([1.0, 3.0, 1.0, 3.0]) and k.calls == 4


def test_timers_satisfy_the_protocol():
    assert isinstance(FakeTimer(), Timer)
    assert isinstance(CpuTimer(), Timer)


def test_cpu_timer_measures_a_sleep_as_off_cpu():
    t = CpuTimer()
    start = t.start()
    time.sleep(0.02)
    pending = t.stop(start)
    assert 19.0 <= t.elapsed_ms(pending) < 200.0
    assert t.offcpu_ms(pending) > 0.8 * t.elapsed_ms(pending)


def test_cpu_timer_busy_loop_is_on_cpu():
    t = CpuTimer()
    start = t.start()
    deadline = time.perf_counter() + 0.02
    while time.perf_counter() < deadline:
        pass
    pending = t.stop(start)
    # on a shared 2-core machine a busy loop is preempted a lot, but it does run;
    # a sleep of the same length runs for microseconds
    on_cpu_ms = t.elapsed_ms(pending) - t.offcpu_ms(pending)
    assert on_cpu_ms > 2.0


def test_cpu_timer_resolution_is_sub_millisecond():
    assert 0 < CpuTimer().resolution_ms < 0.5


def test_make_timer_by_device_string():
    assert isinstance(make_timer("cpu"), CpuTimer)
    assert isinstance(make_timer(None), CpuTimer)
    with pytest.raises(UnknownDevice):  # the same error krex.region gives
        make_timer("tpu:0")
    with pytest.raises(UnknownDevice):
        make_timer("cuda:x")


def test_make_timer_without_driver_raises_a_typed_error():
    if os.path.exists("/usr/lib/x86_64-linux-gnu/libcuda.so.1"):
        pytest.skip("a CUDA driver is installed")
    with pytest.raises(events.DeviceTimerUnavailable) as info:
        events.DriverEventTimer(0)
    assert info.value.hint


def test_parse_cache_size():
    assert cache.parse_size("32768K") == 32 << 20
    assert cache.parse_size("1M\n") == 1 << 20
    assert cache.parse_size("512") == 512


def test_last_level_cache_from_sysfs(tmp_path):
    for i, (level, size) in enumerate([(1, "32K"), (2, "1024K"), (3, "16384K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    assert cache.last_level_cache_bytes(str(tmp_path)) == 16 << 20
    assert cache.last_level_cache_bytes(str(tmp_path / "missing")) == cache.DEFAULT_LLC_BYTES


def _cache_dir(root, caches):
    for i, (level, kind, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")


def test_a_core_holds_its_data_and_unified_caches(tmp_path):
    caches = [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", "2048K"),
              (3, "Unified", "30720K")]
    _cache_dir(tmp_path / "cpu0" / "cache", caches)
    _cache_dir(tmp_path / "cpu1" / "cache", caches[:3])  # a core without the shared level
    assert cache.core_cache_bytes(str(tmp_path / "cpu0" / "cache")) == (48 + 2048 + 30720) << 10
    assert cache.timed_core_cache_bytes({0, 1}, str(tmp_path)) == (48 + 2048 + 30720) << 10
    assert cache.timed_core_cache_bytes({1}, str(tmp_path)) == (48 + 2048) << 10


def test_cpu_flusher_holds_what_the_core_caches_capped():
    flusher = cache.CpuCacheFlusher()
    expected = min(cache.timed_core_cache_bytes(), cache.FLUSH_CAP_BYTES)
    assert flusher.size_bytes == expected == CpuTimer().flush_bytes
    assert flusher.size_bytes <= cache.FLUSH_CAP_BYTES
    flusher.flush()
    assert cache.CpuCacheFlusher(1 << 20).size_bytes == 1 << 20


def test_cpu_clocks_and_throttle_reason():
    assert "cpu_mhz" in clocks.sample("cpu") or not os.path.exists("/proc/cpuinfo")
    assert clocks.throttle_reason({"cpu_mhz": 3000}, {"cpu_mhz": 2990}) is None
    assert "fell" in clocks.throttle_reason({"cpu_mhz": 3000}, {"cpu_mhz": 2000})
    assert clocks.throttle_reason({}, {"throttle_reasons": 0x1}) is None  # idle is benign
    assert "0x40" in clocks.throttle_reason({}, {"throttle_reasons": 0x41})
    assert clocks.sample("fakegpu:0") == {}


def test_cuda_clocks_without_nvml_are_empty():
    assert isinstance(clocks.sample("cuda:0"), dict)
