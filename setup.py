"""Package discovery for the one distribution.

The ``certify/`` and ``analysis/`` folders install as ``lipvit.certify`` and
``lipvit.analysis``: nothing named certify or analysis lands at the top level of
site-packages. Every package under the three folders is found, not listed, so a
new subpackage cannot be left out of the wheel (tests/test_wheel.py).
"""

from setuptools import find_packages, setup

MAPPED = {"lipvit.certify": "certify", "lipvit.analysis": "analysis"}


def discovered() -> list[str]:
    packages = find_packages(include=["lipvit", "lipvit.*"])
    packages = [p for p in packages]
    for name, folder in MAPPED.items():
        packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(packages)


setup(packages=discovered(), package_dir=MAPPED)
