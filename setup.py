"""Maps the top-level component folders into the `atoll` namespace (metadata lives in pyproject.toml)."""

from setuptools import find_packages, setup

# folder -> package; nothing is installed as a top-level `node`, `coordinator` or `compression`
COMPONENTS = {"atoll": "atoll", "coordinator": "atoll.coordinator", "node": "atoll.node", "compression": "atoll.compression",
              "launch": "atoll.launch", "examples": "atoll.examples"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder, package in COMPONENTS.items():
    package_dir[package] = folder
    packages.append(package)
    packages.extend(f"{package}.{sub}" for sub in find_packages(folder))

# folders of data files only (the built-in corpus, the example cluster files): packages of their own, or setuptools
# warns at every install that they would be ignored
packages += ["atoll.data", "atoll.examples.clusters", "atoll.coordinator.dashboard.static"]
setup(packages=packages, package_dir=package_dir)
