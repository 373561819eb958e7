"""`cachectl db`: the index schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from cachectl.cli.render import emit, json_option, stdout

if TYPE_CHECKING:
    from cachectl.context import Context

# cachectl.index.db (SQLAlchemy, Alembic) is imported by the command bodies when they run, never
# at import: `cachectl db upgrade --help` stays cheap.


@dataclass(frozen=True)
class SchemaState:
    url: str
    current: str | None
    head: str

    @property
    def up_to_date(self) -> bool:
        return self.current == self.head


@click.group("db")
def db_group() -> None:
    """Index schema migrations (Alembic, shipped with cachectl)."""


@db_group.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@json_option
@click.pass_obj
def upgrade(ctx: Context, revision: str, as_json: bool) -> None:
    """Create or migrate the index schema (SQLite or PostgreSQL); an SQLite file's missing
    directory is created."""
    from cachectl.index import db as index_db

    engine = index_db.make_engine(ctx.settings.db, create=True)
    before = index_db.current_revision(engine)
    index_db.upgrade(engine, revision)
    state = SchemaState(
        index_db.safe_url(engine), index_db.current_revision(engine), index_db.head_revision()
    )
    emit(
        {"url": state.url, "from": before, "to": state.current},
        as_json,
        lambda r: stdout.print(f"index {r['url']}: {r['from'] or 'empty'} -> {r['to']}"),
    )


@db_group.command("current")
@json_option
@click.pass_obj
def current(ctx: Context, as_json: bool) -> None:
    """Show the index's schema revision and whether it is up to date."""
    from cachectl.index import db as index_db

    engine = index_db.make_engine(ctx.settings.db)
    state = SchemaState(
        index_db.safe_url(engine), index_db.current_revision(engine), index_db.head_revision()
    )
    emit(
        {
            "url": state.url,
            "current": state.current,
            "head": state.head,
            "up_to_date": state.up_to_date,
        },
        as_json,
        lambda r: stdout.print(
            f"index {r['url']}: revision {r['current'] or 'none'} "
            f"({'up to date' if r['up_to_date'] else 'head is ' + r['head']})"
        ),
    )


def register(cli: click.Group) -> None:
    cli.add_command(db_group)
