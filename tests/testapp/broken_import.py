"""A module of an installed app that fails to import: a job naming it is refused."""

raise RuntimeError("this module cannot be imported")
