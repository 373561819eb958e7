from server.app import create_app as create_app
from server.app import freeze_startup_heap as freeze_startup_heap
from server.app import listening_on as listening_on
