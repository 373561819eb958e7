from server.http_edge import BoundedHttpTools as BoundedHttpTools
from server.http_edge import bounded_http as bounded_http
