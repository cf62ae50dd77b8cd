// mutexcron dashboard: refreshes the page's sections in place, and sends actions with the token.
(function () {
  "use strict";
  const meta = (name) => (document.querySelector(`meta[name="${name}"]`) || {}).content || "";
  const base = meta("mc-base"), page = meta("mc-page"), csrf = meta("mc-csrf");
  const refresh = Math.max(500, Number(meta("mc-refresh")) * 1000 || 2000);
  const stamp = document.getElementById("stamp"), flash = document.getElementById("flash");
  const store = window.sessionStorage;

  async function poll() {
    try {
      const response = await fetch(`${base}/api/sections/${page}${location.search}`, { headers: { Accept: "application/json" }, cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      for (const [id, html] of Object.entries(data.sections)) {
        const element = document.getElementById(`s-${id}`);
        if (element && element.innerHTML !== html) element.innerHTML = html;
      }
      restoreOutcomes();
      stamp.textContent = `updated ${data.at.replace("T", " ").slice(0, 19)} UTC · every ${refresh / 1000}s`;
      stamp.classList.remove("stale");
    } catch (error) {
      stamp.textContent = `not updated: ${error.message}; retrying`;
      stamp.classList.add("stale");
    } finally {
      setTimeout(poll, refresh);
    }
  }

  function say(text, ok) {
    const line = document.createElement("div");
    line.className = ok ? "ok" : "err";
    line.textContent = text;
    flash.replaceChildren(line);
  }

  // -- the token: kept in this tab's session storage, sent as a header, never a cookie --------
  const form = document.getElementById("token");
  function showToken() {
    const state = document.getElementById("token-state");
    if (state) state.textContent = store.getItem("mc-token") ? `actions as ${store.getItem("mc-name") || "anonymous"}` : "";
  }
  if (form) {
    document.getElementById("token-name").value = store.getItem("mc-name") || "";
    // The token is checked as it is entered (a POST that changes nothing): a wrong one is said at once.
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const value = document.getElementById("token-value").value;
      const state = document.getElementById("token-state");
      store.setItem("mc-name", document.getElementById("token-name").value);
      document.getElementById("token-value").value = "";
      if (!value) { store.removeItem("mc-token"); showToken(); return; }
      store.setItem("mc-token", value);
      try {
        await act("token", {});
        showToken();
        state.textContent = `token accepted: ${state.textContent}`;
        state.className = "ok";
      } catch (error) {
        store.removeItem("mc-token");
        state.textContent = `token refused: ${error.message}`;
        state.className = "err";
      }
    });
    showToken();
  }

  async function act(name, args) {
    const response = await fetch(`${base}/api/actions/${name}`, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": csrf, Authorization: `Bearer ${store.getItem("mc-token") || ""}` },
      body: JSON.stringify({ ...args, by: store.getItem("mc-name") || "" }),
    });
    const data = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
    if (!response.ok) throw new Error(data.error || `HTTP ${response.status}`);
    return data;
  }

  // A duration in the unit that suits it, as the server's tables and charts show it (charts.seconds).
  const seconds = (value) => value < 0.001 ? `${(value * 1e6).toFixed(0)}µs` : value < 1 ? `${(value * 1000).toFixed(0)}ms`
    : value < 120 ? `${value.toFixed(1)}s` : `${(value / 60).toFixed(0)}m`;

  // -- a trigger's outcome: followed until the run is recorded -------------------------------
  const outcomes = {};
  function restoreOutcomes() {
    for (const [job, shown] of Object.entries(outcomes)) {
      for (const element of document.querySelectorAll(".outcome")) {
        if (element.dataset.job === job) { element.textContent = shown.text; element.className = `outcome ${shown.cls}`; }
      }
    }
  }
  function showOutcome(job, text, cls) { outcomes[job] = { text, cls }; restoreOutcomes(); }

  async function follow(job, lock, fireTime) {
    const query = new URLSearchParams({ job, lock, fire_time: fireTime || "" });
    for (let i = 0; i < 240; i++) {
      await new Promise((done) => setTimeout(done, 500));
      const data = await (await fetch(`${base}/api/trigger?${query}`, { cache: "no-store" })).json();
      if (data.state === "queued" || data.state === "running") {
        showOutcome(job, data.state === "running" ? `running on ${data.node}…` : "waiting for the holder…", "");
        continue;
      }
      const ran = data.merged ? `merged into the run at ${data.fire_time}` : "ran";
      if (data.state === "success") showOutcome(job, `${ran}: success${data.duration != null ? ` in ${seconds(data.duration)}` : ""} on ${data.node}`, "ok");
      else if (data.state === "error") showOutcome(job, `${ran}: error: ${data.error}${data.node ? ` on ${data.node}` : ""}`, "err");
      else showOutcome(job, data.note || data.state, "");
      return;
    }
    showOutcome(job, "no outcome within 2 minutes", "err");
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const args = JSON.parse(button.dataset.args || "{}");
    if (button.dataset.prompt) {  // an action that takes a value (a new schedule): asked for, checked by the server
      const value = window.prompt(button.dataset.prompt);
      if (value === null) return;
      args.schedule = value;
    }
    if (button.dataset.confirm && !window.confirm(button.dataset.confirm)) return;
    button.disabled = true;
    try {
      const result = await act(button.dataset.action, args);
      say(result.message || "done", true);
      if (button.dataset.action === "trigger") {
        showOutcome(args.job, "requested…", "");
        follow(args.job, args.lock, result.fire_time);
      }
      for (const [job, fireTime] of Object.entries(result.fire_times || {})) {  // a resume's catch-up requests
        showOutcome(job, "catch-up requested…", "");
        follow(job, args.lock, fireTime);
      }
    } catch (error) {
      say(error.message, false);
    } finally {
      button.disabled = false;
    }
  });

  setTimeout(poll, refresh);
})();
