function (newDoc, oldDoc, userCtx, secObj) {
  // Installed by `producer install` as _design/spiegel. Rejects invalid rule docs at write time;
  // the services re-validate every rule with the same rules (and RE2 regexes) when they load it.
  if (newDoc._deleted) return;
  var id = newDoc._id || '';
  if (id.indexOf('_design/') === 0 || id.indexOf('spiegel_cp_') === 0 || id === 'spiegel_producer_seq') return;
  var t = newDoc.type;
  if (t !== 'replicator' && t !== 'on_change') return;
  function fail(field, reason) {
    throw ({forbidden: 'rule "' + id + '": field "' + field + '": ' + reason});
  }
  function noPassword(field, u) {
    if (typeof u === 'string' && /^[a-z][a-z0-9+.\-]*:\/\/[^\/@?#]*:[^\/@?#]*@/i.test(u)) {
      fail(field, 'password in URL: put it in the passwords file');
    }
  }
  function regex(field, v) {
    if (v === undefined || v === null) return;
    if (typeof v !== 'string') fail(field, 'must be a string (an RE2 regular expression)');
    try { new RegExp(v); } catch (e) { fail(field, 'invalid regular expression: ' + e.message); }
  }
  function bool(field) {
    if (newDoc[field] !== undefined && typeof newDoc[field] !== 'boolean') fail(field, 'must be true or false');
  }
  bool('disabled');
  regex('db_name', newDoc.db_name);
  if (t === 'replicator') {
    if (typeof newDoc.source !== 'string' || newDoc.source === '') fail('source', 'required: a URL or a db name');
    if (typeof newDoc.target !== 'string' || newDoc.target === '') fail('target', 'required: a URL or a db name');
    noPassword('source', newDoc.source);
    noPassword('target', newDoc.target);
    var d = newDoc.dirty_after_milliseconds;
    if (d !== undefined && d !== null && (typeof d !== 'number' || d < 0)) fail('dirty_after_milliseconds', 'must be a number of milliseconds, 0 or more');
    if (newDoc.engine !== undefined && newDoc.engine !== 'couchdb' && newDoc.engine !== 'native') fail('engine', 'must be "couchdb" or "native"');
    return;
  }
  var hasURL = typeof newDoc.url === 'string' && newDoc.url !== '';
  var hasSubject = typeof newDoc.subject === 'string' && newDoc.subject !== '';
  var hasMirror = typeof newDoc.mirror === 'string' && newDoc.mirror !== '';
  if ((hasURL ? 1 : 0) + (hasSubject ? 1 : 0) + (hasMirror ? 1 : 0) !== 1) {
    fail(hasMirror ? 'mirror' : hasURL ? 'subject' : 'url', 'exactly one of url, subject and mirror is required');
  }
  if (newDoc.mirror !== undefined && !/^[a-zA-Z0-9_-]+$/.test(String(newDoc.mirror))) fail('mirror', 'must be a NATS KV bucket name (letters, digits, - and _)');
  noPassword('url', newDoc.url);
  if (newDoc.method !== undefined && ['GET', 'POST', 'PUT', 'PATCH', 'DELETE'].indexOf(String(newDoc.method).toUpperCase()) < 0) {
    fail('method', 'must be GET, POST, PUT, PATCH or DELETE');
  }
  if (newDoc['if'] !== undefined && newDoc['if'] !== null) {
    if (typeof newDoc['if'] !== 'object' || Array.isArray(newDoc['if'])) fail('if', 'must be an object of field: regex or null');
    for (var k in newDoc['if']) regex('if.' + k, newDoc['if'][k]);
  }
  if (newDoc.since !== undefined && newDoc.since !== 'beginning' && newDoc.since !== 'now') fail('since', 'must be "beginning" or "now"');
  bool('block');
  bool('debounce');
  bool('follow_redirects');
}
