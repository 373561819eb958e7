from server.config import ServerSettings as ServerSettings
from server.config import load_server_settings as load_server_settings
