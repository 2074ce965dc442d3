"""A server binary from a Debian package, for the tests that start one (etcd, Prometheus)."""
import os
import shutil
import subprocess
from typing import Optional


def debian_binary(binary: str, package: str) -> Optional[str]:
    """The path of `binary`, installing `package` once if it is missing and we are root (the test
    targets install it too; this covers a test run by hand on a fresh machine)."""
    if shutil.which(binary) is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-qq", package]
        # A fresh image has no package lists yet: update once, only when the plain install fails.
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
    return shutil.which(binary)
