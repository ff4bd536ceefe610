#!/usr/bin/env python3
"""Run the workspace's test binaries several at a time (hack/test.sh).

    hack/run-tests.py BUILD_JSON LOG_DIR

BUILD_JSON is the output of `cargo test --workspace --no-run
--message-format=json-render-diagnostics`: its `compiler-artifact` messages
name each test executable. Lanes run at once, each one binary after
another (the tests inside a binary run in parallel, as under `cargo test`):

- lane "apart": the binaries that need no libvirtd: unit tests of every
  crate but the libvirt provider's, vmlet's tests in APART_TESTS (the
  control plane, libvirt's in-process test driver, the Nova harness, the
  vSphere simulator) and the OpenStack and vSphere providers' tests;
- lanes "libvirtd-1" .. "libvirtd-<LIBVIRTD_LANES>": every other binary
  (real guests on qemu:///system and the two harness hosts), taken from one
  queue, longest first (ESTIMATED_SECONDS). Two rules keep them apart where they share
  more than a daemon: ALONE (tests/outage.rs stops libvirtd) runs first,
  while no other libvirtd binary runs; the binaries in MIG_HOSTS (the two
  harness hosts mig-a and mig-b and their LAN) run one at a time. A new test
  file lands in these lanes unless listed in APART_TESTS.

Each binary runs in its package's directory, as cargo runs it, under a
deadline (BINARY_DEADLINE); its output goes to LOG_DIR/<lane>.log, printed
lane by lane once all are done, then each binary's seconds. Exits 1 when a
binary failed or hit its deadline, naming them.
"""

import json
import os
import subprocess
import sys
import threading
import time

# vmlet's test files (tests/<name>.rs) that use no libvirtd.
APART_TESTS = {"bootstrap", "cluster", "fleet", "forged_pods", "kubelet_api", "nova", "rbac", "vsphere"}
# Packages none of whose tests use libvirtd.
APART_PACKAGES = {"vmlet-openstack", "vmlet-vsphere", "vmlet-provider", "vmlet-provider-conformance"}
# (package, test) binaries that must run while no other libvirtd binary does.
ALONE = {("vmlet", "outage")}
# (package, test) binaries that use the harness hosts mig-a/mig-b: one at a time.
MIG_HOSTS = {("vmlet", "migration"), ("vmlet", "networking"), ("vmlet-libvirt", "migration"),
             ("vmlet-libvirt", "resize")}
# Rough seconds of the long binaries (a warm CI run), to start them first.
ESTIMATED_SECONDS = {"console": 125, "provisioner": 95, "qemu": 92, "backup": 75, "migration": 57,
                     "cloud_init": 45, "networking": 38, "snapshot": 35, "conformance": 33}
# Lanes for the libvirtd binaries. Two were tried: the real guest of
# tests/backup.rs's data-claim test then never answered an exec in 2 of 3
# runs (root cause not found; it passed in every run of one binary at a
# time), so the guests run one binary at a time, beside the "apart" lane.
LIBVIRTD_LANES = 1
# How long one test binary may run; then it is killed and counted failed.
BINARY_DEADLINE = 30 * 60


class Binary:
    def __init__(self, message):
        target = message["target"]
        self.package = package_name(message)
        self.target = target["name"]
        self.kind = target["kind"][0]
        self.directory = os.path.dirname(message["manifest_path"])
        self.executable = message["executable"]
        unit = self.kind in ("lib", "bin") and self.package != "vmlet-libvirt"
        self.apart = self.package in APART_PACKAGES or unit or self.target in APART_TESTS
        self.key = (self.package, self.target)

    def label(self):
        return f"{self.package} {self.kind} {self.target}"


def binaries(build_json):
    """Every test executable the build names."""
    found = []
    with open(build_json) as f:
        for line in f:
            if not line.startswith("{"):
                continue
            message = json.loads(line)
            if message.get("reason") == "compiler-artifact" and message.get("executable") and message["profile"]["test"]:
                found.append(Binary(message))
    return found


def package_name(message):
    """The package's name, from its package id: `path+file:///dir#name@1.0.0`,
    or `path+file:///dir/name#1.0.0` when the directory bears the name."""
    url, _, version = message["package_id"].partition("#")
    return version.split("@", 1)[0] if "@" in version else os.path.basename(url)


class Queue:
    """The libvirtd binaries, handed out under the ALONE and MIG_HOSTS rules."""

    def __init__(self, items):
        self.items = sorted(items, key=lambda b: (b.key not in ALONE, -ESTIMATED_SECONDS.get(b.target, 30), b.key))
        self.running = set()
        self.lock = threading.Condition()

    def runnable(self, binary):
        if binary.key in ALONE:
            return not self.running
        if any(key in ALONE for key in self.running):
            return False
        return binary.key not in MIG_HOSTS or not any(key in MIG_HOSTS for key in self.running)

    def take(self):
        with self.lock:
            while self.items:
                # ALONE binaries sort first: nothing may pass them while they wait.
                candidates = self.items[:1] if self.items[0].key in ALONE else self.items
                for binary in candidates:
                    if self.runnable(binary):
                        self.items.remove(binary)
                        self.running.add(binary.key)
                        return binary
                self.lock.wait()
            return None

    def done(self, binary):
        with self.lock:
            self.running.discard(binary.key)
            self.lock.notify_all()


def run_lane(lane, next_binary, finished, log_dir, results):
    with open(os.path.join(log_dir, f"{lane}.log"), "w") as log:
        while (binary := next_binary()) is not None:
            log.write(f"\n===== {binary.label()} ({binary.executable})\n")
            log.flush()
            start = time.monotonic()
            try:
                code = subprocess.run([binary.executable], cwd=binary.directory, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=BINARY_DEADLINE).returncode
            except subprocess.TimeoutExpired:
                code = f"killed at its {BINARY_DEADLINE}s deadline"
            took = time.monotonic() - start
            finished(binary)
            log.write(f"===== {binary.label()}: exit {code} in {took:.0f}s\n")
            log.flush()
            results.append((lane, binary.label(), code, took))


def main():
    build_json, log_dir = sys.argv[1], sys.argv[2]
    os.makedirs(log_dir, exist_ok=True)
    found = binaries(build_json)
    if not found:
        print("run-tests.py: the build named no test binaries", file=sys.stderr)
        return 1
    apart = sorted((b for b in found if b.apart), key=lambda b: b.key)
    queue = Queue([b for b in found if not b.apart])
    lanes = {"apart": (lambda: apart.pop(0) if apart else None, lambda _: None)}
    for lane in [f"libvirtd-{n}" for n in range(1, LIBVIRTD_LANES + 1)]:
        lanes[lane] = (queue.take, queue.done)
    results = []
    started = time.monotonic()
    threads = [threading.Thread(target=run_lane, args=(lane, take, done, log_dir, results))
               for lane, (take, done) in lanes.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for lane in lanes:
        with open(os.path.join(log_dir, f"{lane}.log")) as log:
            sys.stdout.write(f"\n########## test lane {lane} ##########\n")
            sys.stdout.write(log.read())
    print(f"\nrun-tests.py: {len(results)} test binaries in {time.monotonic() - started:.0f}s")
    for lane in lanes:
        mine = [r for r in results if r[0] == lane]
        print(f"  lane {lane}: {len(mine)} binaries, {sum(r[3] for r in mine):.0f}s")
        for _, label, code, took in sorted(mine, key=lambda r: -r[3]):
            print(f"    {took:6.0f}s  {label}{'' if code == 0 else f'  FAILED ({code})'}")
    failed = [r for r in results if r[2] != 0]
    for lane, label, code, _ in failed:
        print(f"run-tests.py: FAILED: {label} (lane {lane}, exit {code})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
