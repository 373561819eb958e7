from server.accel import DEFAULT_PREFIX as DEFAULT_PREFIX
from server.accel import local_roots as local_roots
from server.accel import nginx_config as nginx_config
