// Hash routes: #/adapters, #/tenants, ... Each page module exports `title` and
// `render(container)`, which may return a cleanup function (stop polling, say) called when the
// page is left.

export function createRouter({ routes, fallback, container, onChange }) {
  let cleanup = null;

  function current() {
    const name = window.location.hash.replace(/^#\/?/, "").split(/[/?]/)[0];
    return routes[name] ? name : fallback;
  }

  async function show() {
    const name = current();
    if (`#/${name}` !== window.location.hash) {
      window.history.replaceState(null, "", `#/${name}`);
    }
    if (cleanup) {
      cleanup();
      cleanup = null;
    }
    const page = routes[name];
    container.replaceChildren();
    onChange(name, page);
    const result = page.render(container);
    cleanup = typeof result === "function" ? result : null;
  }

  function stop() {
    window.removeEventListener("hashchange", show);
    if (cleanup) cleanup();
    cleanup = null;
  }

  window.addEventListener("hashchange", show);
  return { show, stop };
}
