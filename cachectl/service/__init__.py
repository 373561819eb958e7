"""Service side: activate(), the service's index access, its environment, the exec hook, doctor and the mirror."""
