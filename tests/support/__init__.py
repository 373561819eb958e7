"""What tests share: servers and processes (infra), test programs, manifests and environments.

On the import path through pytest's ``pythonpath``; no test module imports another.
"""
