"""Package discovery for the folder layout asked for by the user.

``adapters/``, ``kernels/`` and ``sim/`` live beside ``hybridcache/`` in the repository but
install as ``hybridcache.adapters``, ``hybridcache.kernels`` and ``hybridcache.sim``, so
nothing lands in the top-level import namespace. Metadata lives in pyproject.toml.
"""

from setuptools import find_packages, setup

SIDE_FOLDERS = ("adapters", "kernels", "sim")

packages = ["hybridcache"] + [f"hybridcache.{p}" for p in find_packages("hybridcache")]
package_dir = {"hybridcache": "hybridcache"}
for folder in SIDE_FOLDERS:
    packages.append(f"hybridcache.{folder}")
    packages += [f"hybridcache.{folder}.{p}" for p in find_packages(folder)]
    package_dir[f"hybridcache.{folder}"] = folder

setup(packages=packages, package_dir=package_dir)
