from server.config import WORKER_LOG_LEVEL_ENV as WORKER_LOG_LEVEL_ENV
from server.config import WORKER_SETTINGS_ENV as WORKER_SETTINGS_ENV
from server.config import ServerSettings as ServerSettings
from server.config import load_server_settings as load_server_settings
from server.config import settings_to_env as settings_to_env
