"""The admin web UI: plain HTML, CSS and JavaScript modules with no build step, served by
`loraplex serve` at /admin. Installed as the package loraplex.admin_ui so that the server finds
its files wherever loraplex is installed."""
