# cachectl_migrations is migrations/ once installed (see typings/README.md).
