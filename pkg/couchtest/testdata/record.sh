#!/usr/bin/env bash
# Records the exchanges of a CouchDB 3 server into OUTDIR/NAME.http (format: README.md in this
# folder). Usage:
#
#   COUCH=http://127.0.0.1:5986 COUCH_USER=admin COUCH_PASS=secret \
#     pkg/couchtest/testdata/record.sh pkg/couchtest/testdata/couchdb-3.5
#
# For a cluster, COUCH is the node the exchanges go to and COUCH2 another node of the same
# cluster: the cluster-only exchanges (*-other-node, membership) are then recorded as well.
#
# The user must be a server admin. It creates and deletes the dbs fx_src, fx_tgt, fx_sel,
# fx_created, fx_late and the user fx_user; nothing else on the server is touched. The password
# and user name never reach the files: they are replaced by PASS and USER, the derived key and
# salt of the _users doc by zeros of the same length, and the cookie of _session is not recorded.
set -euo pipefail

OUT=${1:?usage: record.sh OUTDIR}
: "${COUCH:?COUCH is the server URL without credentials}"
: "${COUCH_USER:?}" "${COUCH_PASS:?}"
COUCH2=${COUCH2:-}
AUTH="$COUCH_USER:$COUCH_PASS"
HOSTPORT=${COUCH#http://}
CRED_URL="http://$AUTH@$HOSTPORT"
USERPW="fx-user-pw-1"
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# sanitize: credentials out of a recorded file.
sanitize() {
	P=$COUCH_PASS U=$COUCH_USER W=$USERPW perl -pi -e \
		's/\Q$ENV{P}\E/PASS/g; s/\Q$ENV{W}\E/USERPW/g; s/(?<![\w.-])\Q$ENV{U}\E(?![\w.-])/USER/g' "$1"
}

# rec NAME METHOD PATH [BODY [BASE [CURLARGS...]]]: one exchange, written to OUT/NAME.http.
rec() {
	local name=$1 method=$2 path=$3 body=${4:-} base=${5:-$COUCH}
	shift $(($# < 5 ? $# : 5))
	local f="$OUT/$name.http"
	local args=(-sS -X "$method" -D "$tmp/h" -o "$tmp/b" "$@")
	[ -n "$body" ] && args+=(-H 'Content-Type: application/json' --data-binary "$body")
	# a continuous feed that the server does not end is cut by the client (-m, curl's exit 28)
	curl "${args[@]}" -u "$AUTH" "$base$path" || [ $? -eq 28 ]
	write "$f" "$method $path" "$body"
}

# write FILE REQUESTLINE BODY: the request lines, the status and Content-Type of $tmp/h and the
# body $tmp/b byte for byte.
write() {
	local f=$1
	{
		printf '> %s\n' "$2"
		[ -n "$3" ] && printf '> %s\n' "$3"
		printf '< %s\n' "$(head -n1 "$tmp/h" | tr -d '\r')"
		grep -i '^content-type:' "$tmp/h" | tr -d '\r' | sed 's/^[Cc]ontent-[Tt]ype: */< Content-Type: /' || true
		printf '\n'
		cat "$tmp/b"
	} >"$f"
	# the computed derived key and salt are hex; keep their length (it tells the prf) as zeros
	if grep -q '"derived_key"' "$f"; then
		python3 - "$f" <<-'EOF'
			import re, sys
			p = sys.argv[1]
			s = open(p).read()
			s = re.sub(r'"(derived_key|salt)":"([0-9a-f]*)"', lambda m: '"%s":"%s"' % (m.group(1), "0" * len(m.group(2))), s)
			open(p, "w").write(s)
		EOF
	fi
	sanitize "$f"
}

get() { curl -sS -u "$AUTH" "$COUCH$1"; }
put() { curl -sS -u "$AUTH" -X PUT -H 'Content-Type: application/json' ${2:+--data-binary "$2"} "$COUCH$1" >/dev/null; }
del() { curl -sS -u "$AUTH" -X DELETE "$COUCH$1" >/dev/null; }

for db in fx_src fx_tgt fx_sel fx_created fx_late; do del "/$db"; done
rev=$(get /_users/org.couchdb.user:fx_user | jq -r '._rev // empty')
[ -n "$rev" ] && del "/_users/org.couchdb.user:fx_user?rev=$rev"

SINCE=$(get '/_db_updates?feed=normal&since=now' | jq -r .last_seq)

put /fx_tgt
rec put-db PUT /fx_src
put /fx_src/doc2 '{"n":2,"type":"post"}'
put /fx_src/doc1 '{"n":1,"type":"post"}'
put /fx_src/doc3 '{"n":3,"type":"post"}'
rec put-doc PUT /fx_src/doc4 '{"n":4,"type":"post"}'
rec put-doc-conflict PUT /fx_src/doc4 '{"n":5}'
rec get-db GET /fx_src
rec changes-normal GET '/fx_src/_changes?include_docs=true&style=all_docs'
last=$(jq -r .last_seq <"$tmp/b")
rec changes-since-last GET "/fx_src/_changes?since=$last"

rec db-updates-normal GET "/_db_updates?feed=normal&since=$SINCE"
rec db-updates-limit GET "/_db_updates?feed=normal&limit=2&since=$SINCE"
rec db-updates-continuous GET '/_db_updates?feed=continuous&timeout=2000&heartbeat=500&since=now' "" "$COUCH" -m 6
(
	sleep 1
	put /fx_late
	put /fx_late/d '{"n":1}'
	del /fx_late
) &
rec db-updates-continuous-live GET '/_db_updates?feed=continuous&timeout=3000&heartbeat=1000&since=now' "" "$COUCH" -m 8
wait
rec db-updates-longpoll GET '/_db_updates?feed=longpoll&since=now&timeout=1000'

rev=$(get /fx_src/doc1 | jq -r ._rev)
del "/fx_src/doc1?rev=$rev"
rec changes-with-deletion GET '/fx_src/_changes?style=all_docs'
rec changes-limit GET '/fx_src/_changes?limit=2'
rec changes-continuous GET '/fx_src/_changes?feed=continuous&timeout=1500&heartbeat=500&include_docs=true' "" "$COUCH" -m 6
rec changes-longpoll-empty GET '/fx_src/_changes?feed=longpoll&since=now&timeout=1000'
rec dbs-info POST /_dbs_info '{"keys":["fx_src","fx_tgt","fx_missing"]}'
rec put-local PUT /fx_src/_local/ckpt '{"session_id":"s1","source_last_seq":"1-abc","history":[]}'
rec get-local GET /fx_src/_local/ckpt

rec replicate-oneshot POST /_replicate "{\"source\":\"$CRED_URL/fx_src\",\"target\":\"$CRED_URL/fx_tgt\"}"
rec replicate-no-changes POST /_replicate "{\"source\":\"$CRED_URL/fx_src\",\"target\":\"$CRED_URL/fx_tgt\"}"
rec replicate-missing-source POST /_replicate "{\"source\":\"$CRED_URL/fx_nosuch\",\"target\":\"$CRED_URL/fx_tgt\"}"
rec replicate-missing-target POST /_replicate "{\"source\":\"$CRED_URL/fx_src\",\"target\":\"$CRED_URL/fx_notarget\"}"
rec replicate-bad-auth POST /_replicate "{\"source\":\"http://$COUCH_USER:WRONG@$HOSTPORT/fx_src\",\"target\":\"$CRED_URL/fx_tgt\"}"
rec replicate-create-target POST /_replicate "{\"source\":\"$CRED_URL/fx_src\",\"target\":\"$CRED_URL/fx_created\",\"create_target\":true}"
rec delete-db DELETE /fx_created
rec replicate-selector POST /_replicate "{\"source\":\"$CRED_URL/fx_src\",\"target\":\"$CRED_URL/fx_sel\",\"create_target\":true,\"selector\":{\"n\":{\"\$gt\":2}}}"
rec db-updates-after-delete GET '/_db_updates?feed=normal&descending=true&limit=3'

rec put-ddoc-validate PUT /fx_src/_design/v '{"validate_doc_update":"function(n,o,u){ if(n.bad){ throw({forbidden:\"bad field\"}); } }"}'
rec put-doc-forbidden PUT /fx_src/doc9 '{"bad":true}'
rec bulk-get POST '/fx_src/_bulk_get?revs=true&latest=true' '{"docs":[{"id":"doc2","rev":"1-614d864b534ab8997c7b06ce8a683752"},{"id":"nosuch"}]}'
rec revs-diff POST /fx_tgt/_revs_diff '{"doc2":["1-abc","9-zzz"],"nosuch":["1-x"]}'
rec bulk-docs-new-edits-false POST /fx_tgt/_bulk_docs '{"new_edits":false,"docs":[{"_id":"doc2","_rev":"2-0123456789abcdef0123456789abcdef","_revisions":{"start":2,"ids":["0123456789abcdef0123456789abcdef","614d864b534ab8997c7b06ce8a683752"]},"n":22}]}'
rec get-doc-conflicts GET '/fx_tgt/doc2?conflicts=true'
rec open-revs-all GET '/fx_tgt/doc2?open_revs=all&revs=true'
rec global-changes GET "/_global_changes/_changes?limit=5&since=$SINCE"
rec put-db-exists PUT /fx_src
rec put-db-invalid-name PUT /Bad_Name
rec get-db-missing GET /fx_missing
rec all-dbs GET '/_all_dbs?start_key=%22fx_%22&end_key=%22fx_z%22'
rec root GET /

curl -sS -D "$tmp/h" -o "$tmp/b" "$COUCH/_db_updates"
write "$OUT/unauthorized.http" "GET /_db_updates (without credentials)" ""

rec session GET /_session
rec users-put PUT /_users/org.couchdb.user:fx_user "{\"name\":\"fx_user\",\"password\":\"$USERPW\",\"roles\":[],\"type\":\"user\"}"
rec users-doc GET /_users/org.couchdb.user:fx_user
curl -sS -D "$tmp/h" -o "$tmp/b" -X POST -H 'Content-Type: application/json' \
	--data-binary "{\"name\":\"fx_user\",\"password\":\"$USERPW\"}" "$COUCH/_session"
write "$OUT/session-login.http" "POST /_session" "{\"name\":\"fx_user\",\"password\":\"$USERPW\"}"
rec users-doc-after-login GET /_users/org.couchdb.user:fx_user

if [ -n "$COUCH2" ]; then
	rec membership GET /_membership
	rec get-db-other-node GET /fx_src "" "$COUCH2"
	last=$(get '/fx_src/_changes' | jq -r .last_seq)
	rec changes-since-other-node GET "/fx_src/_changes?since=$last" "" "$COUCH2"
	rec db-updates-other-node GET "/_db_updates?feed=normal&since=$SINCE" "" "$COUCH2"
fi

rev=$(get /_users/org.couchdb.user:fx_user | jq -r ._rev)
del "/_users/org.couchdb.user:fx_user?rev=$rev"
for db in fx_src fx_tgt fx_sel; do del "/$db"; done
if grep -rl -e "$COUCH_PASS" -e "$USERPW" "$OUT"; then
	echo "a password is left in the files above" >&2
	exit 1
fi
echo "recorded $(ls "$OUT"/*.http | wc -l) exchanges into $OUT"
