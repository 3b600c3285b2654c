"""Packaging beyond what pyproject.toml can say: the demo model's folder maps into the package."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["gpt_inspector", "gpt_inspector.*"]), "gpt_inspector.demo_model"],
    package_dir={"gpt_inspector.demo_model": "resources/demo-gpt2"},
)
