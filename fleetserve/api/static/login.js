// The login page: the token comes from the link's #fragment (which no browser sends to a
// server) or from the form, is posted once, and the session cookie does the rest.
"use strict";
(function () {
  const error = document.getElementById("login-error");

  async function login(body) {
    error.textContent = "";
    let resp;
    try {
      resp = await fetch("/ui/login", {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body),
        credentials: "same-origin",
      });
    } catch (e) {
      error.textContent = "The controller did not answer: " + e;
      return;
    }
    if (resp.ok) {
      location.replace("/");
      return;
    }
    let message = "HTTP " + resp.status;
    try {
      message = (await resp.json()).error.message || message;
    } catch (e) { /* not JSON */ }
    error.textContent = "Not logged in: " + message;
  }

  // A link from `fleetserve dashboard`: #code=<one-time code>; #token=<token> works too.
  // (Also when the link is opened in a tab that shows this page already: no reload then.)
  function fromLink() {
    const match = /(?:^#|&)(code|token)=([^&]+)/.exec(location.hash);
    if (match) {
      history.replaceState(null, "", "/login"); // it leaves the address bar at once
      login({ [match[1]]: decodeURIComponent(match[2]) });
    }
  }
  window.addEventListener("hashchange", fromLink);
  fromLink();
  document.getElementById("login-form").addEventListener("submit", function (ev) {
    ev.preventDefault();
    login({ token: document.getElementById("token").value.trim() });
  });
})();
