# cachectl_server is server/ once installed (see typings/README.md).
