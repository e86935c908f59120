package couch

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/spiegel-nats/spiegel/pkg/couchtest"
)

// fxSet is what the parsers must read from the exchanges of one fixture set (couchtest.FixtureSets):
// events and changes exactly as recorded.
type fxSet struct {
	set, version                                 string
	liveEvents, normalEvents, globalEvents       []DBEvent
	normalLastSeq, globalLastSeq                 string
	changesNormal, changesDeletion, changesLimit []Change
	changesContinuous                            []Change
	changesNormalLast, changesDeletionLast       string
	changesLimitLast                             string
	changesLimitPending                          int64
	dbsInfoSrc                                   DBInfo
	dbsInfoTgtSeq                                string
	getDBStart, getDBSeq                         string
	allDBsAfter                                  string // all-dbs: AllDBs(allDBsAfter, len(allDBsWant))
	allDBsWant                                   []string
}

// fxSets: CouchDB 3.3.3 (../shared/fixtures/couchdb-3.3), 3.5.2 single node and a three-node
// 3.5.2 cluster (pkg/couchtest/testdata). On the cluster _db_updates sends an event once per
// copy of the _global_changes shard that recorded it (fx_late created three times, an updated
// after a deleted): the feed hands them on as they come.
var fxSets = []fxSet{
	{
		set: couchtest.CouchDB33, version: "3.3.3",
		liveEvents: []DBEvent{
			{DB: "fx_late", Type: "created", Seq: "16-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBApyii"},
			{DB: "_dbs", Type: "updated", Seq: "17-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBBFyij"},
			{DB: "fx_late", Type: "updated", Seq: "18-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTuXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBBOSik"},
			{DB: "fx_late", Type: "deleted", Seq: "19-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTeXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBBqSil"},
			{DB: "_dbs", Type: "updated", Seq: "20-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTeXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CGmWZqam6eaY9OXBQBCGSim"},
		},
		normalEvents: []DBEvent{
			{DB: "db_b", Type: "created", Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGgyIJc"},
			{DB: "db_b", Type: "updated", Seq: "4-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGkcIJo"},
			{DB: "db_c", Type: "created", Seq: "5-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGlqIJs"},
			{DB: "db_c", Type: "updated", Seq: "7-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgT2XOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGoGIJ0"},
			{DB: "fx_tgt", Type: "created", Seq: "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGpUIJ4"},
			{DB: "db_a", Type: "created", Seq: "9-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTGCGmWZqam6eaY9OXBQA_HSib"},
			{DB: "db_a", Type: "updated", Seq: "11-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTmCGmWZqam6eaY9OXBQA_YSid"},
			{DB: "fx_src", Type: "created", Seq: "12-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DTWCCmWZqam6eaY9OXBQA_gyie"},
			{DB: "fx_src", Type: "updated", Seq: "14-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQA_xyig"},
			{DB: "_dbs", Type: "updated", Seq: "15-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBANyih"},
		},
		normalLastSeq: "15-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_1DT2CCmWZqam6eaY9OXBQBANyih",
		globalEvents: []DBEvent{
			{DB: "db_b", Type: "created", Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGgyIJc"},
			{DB: "db_b", Type: "updated", Seq: "4-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGkcIJo"},
			{DB: "db_c", Type: "created", Seq: "5-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTWXOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGlqIJs"},
			{DB: "db_c", Type: "updated", Seq: "7-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgT2XOBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGoGIJ0"},
			{DB: "fx_tgt", Type: "created", Seq: "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGpUIJ4"},
		},
		globalLastSeq: "8-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTOXKBAuzJySkpFhbG2DTgMSaPBUgyNACp_yDTEhmyAGpUIJ4",
		changesNormal: []Change{
			{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKM0ofw", ID: "doc1", Revs: []string{"1-3b6ffcfff90ac68478e8935efb41a87f"}},
			{Seq: "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTGMGmGaUmJZmbG2LTlwUAKT0ogA", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
		},
		changesNormalLast: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ",
		changesDeletion: []Change{
			{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFjBIGQ", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMGmGaUmJZmbG2LTlwUAKYEogg", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		changesDeletionLast: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMGmGaUmJZmbG2LTlwUAKYEogg",
		changesLimit: []Change{
			{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFjBIGQ", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		},
		changesLimitLast: "2-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFjBIGQ", changesLimitPending: 2,
		changesContinuous: []Change{
			{Seq: "1-g1AAAAB5eJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yDTEhmyAFhzIGM", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "3-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTGXOBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMCmGaUmJZmbG2LTlwUAKO8ogA", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_yimGaUmJZmbG2LTlwUAKV8ogQ", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVCJDUv3___-zMpgTmXKBAuwm5hbJqQZJ2DTgMSaPBUgyNACp_1DTmMGmGaUmJZmbG2LTlwUAKYEogg", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		dbsInfoSrc: DBInfo{Name: "fx_src", DocCount: 3, InstanceStartTime: "1795316723",
			UpdateSeq: "5-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRORcowG6UmpRkbm6ITR8e0xIZkuqhxjCBjTExt0hONUjCpiELAPIoKII"},
		dbsInfoTgtSeq: "0-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRIRcowG6UbG6ZZGyKTR8e0xIZkupRjEk2Tks2NbLEpiELAOG3KFQ",
		getDBStart:    "1795316723", getDBSeq: "4-g1AAAACbeJzLYWBgYMpgTmEQTM4vTc5ISXIwNDLXMwBCwxyQVB4LkGRoAFL_gSArgzmRKRcowG6UmpRkbm6ITR8e0xIZkupRjDExt0hONUjCpiELAPG_KIE",
		allDBsAfter: "db_b", allDBsWant: []string{"db_c", "fx_src", "fx_tgt"},
	},

	{
		set: couchtest.CouchDB35, version: "3.5.2",
		liveEvents: []DBEvent{
			{DB: "fx_late", Type: "created", Seq: "27-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBPZwSYaGKSkWhqYYdeZBQBCmSnU"},
			{DB: "fx_late", Type: "updated", Seq: "28-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBM5wCYaGKSkWhqYYdeZBQBCvSnV"},
			{DB: "_dbs", Type: "updated", Seq: "29-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFc4EC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBM5wCYaGKSkWhqYYdeZBQBDMynW"},
			{DB: "_dbs", Type: "updated", Seq: "30-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBPFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBM5wCYaGKSkWhqYYdeZBQBDqSnX"},
			{DB: "fx_late", Type: "deleted", Seq: "31-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBPFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBM5wSYaGKSkWhqYYdeZBQBDzSnY"},
		},
		normalEvents: []DBEvent{
			{DB: "fx_src", Type: "created", Seq: "22-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMFc4EC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBA7ynP"},
			{DB: "_dbs", Type: "updated", Seq: "23-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBBZSnQ"},
			{DB: "fx_src", Type: "updated", Seq: "25-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBCUSnS"},
			{DB: "fx_tgt", Type: "created", Seq: "26-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBPZwCYaGKSkWhqYYdeZBQBCdSnT"},
		},
		normalLastSeq: "26-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNFcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBPZwCYaGKSkWhqYYdeZBQBCdSnT",
		globalEvents: []DBEvent{
			{DB: "fx_src", Type: "created", Seq: "22-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMFc4EC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBA7ynP"},
			{DB: "fx_created", Type: "created", Seq: "29-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMlcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBEKSnW"},
			{DB: "fx_created", Type: "updated", Seq: "31-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOlcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBFFSnY"},
			{DB: "_dbs", Type: "updated", Seq: "33-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNlcoEC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBGASna"},
			{DB: "fx_src", Type: "updated", Seq: "34-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNlc4EC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBGdynb"},
		},
		globalLastSeq: "34-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBNlc4EC7GkpRiaGBkbYteA1Ko8FSDI0AKn_UBNZwSYaGKSkWhqYYdeZBQBGdynb",
		changesNormal: []Change{
			{Seq: "1-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6tUhPQ", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_KCaaWpgnpxolY9eZBQAq6inK", ID: "doc1", Revs: []string{"1-3b6ffcfff90ac68478e8935efb41a87f"}},
			{Seq: "3-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_UBMZwSaaWpgnpxolY9eZBQArYCnL", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_KCaaWpgnpxolY9eZBQArhCnM", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
		},
		changesNormalLast: "4-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_KCaaWpgnpxolY9eZBQArhCnM",
		changesDeletion: []Change{
			{Seq: "1-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6tUhPQ", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6ychPg", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_KCaaWpgnpxolY9eZBQArhCnM", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "5-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_UBOZwSaaWpgnpxolY9eZBQArqCnN", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		changesDeletionLast: "5-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_UBOZwSaaWpgnpxolY9eZBQArqCnN",
		changesLimit: []Change{
			{Seq: "1-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6tUhPQ", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6ychPg", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		},
		changesLimitLast: "2-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6ychPg", changesLimitPending: 2,
		changesContinuous: []Change{
			{Seq: "1-g1AAAAB_eJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_IBMTGbIA6tUhPQ", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "3-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBMZc4EC7EaGxpaGqSbYteA1Ko8FSDI0AKn_UBOZwCaaWpgnpxolY9eZBQArDinL", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "4-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_KCaaWpgnpxolY9eZBQArhCnM", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "5-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkIkNS_f___7MymBOZcoEC7EaGxpaGqSbYteA1Ko8FSDI0AKn_UBOZwSaaWpgnpxolY9eZBQArqCnN", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		dbsInfoSrc: DBInfo{Name: "fx_src", DocCount: 3, InstanceStartTime: "1795647932",
			UpdateSeq: "5-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkHguQZGgAUv-BICuDOZE5FyjAbmphnpxqlIxdJ14TExmS6qFGMYGNMjI0tjRMNcGuJQsAFSMpzQ"},
		dbsInfoTgtSeq: "0-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkHguQZGgAUv-BICuDOZEhFyjAbpRobmZsaYRdJ14TExmS6lGMSrRINjMxsMCuJQsA88opmg",
		getDBStart:    "1795647932", getDBSeq: "4-g1AAAACjeJzLYWBgYMpgTmEQTs4vTc5ISTI2dTA0MtczAELDHJBkHguQZGgAUv-BICuDOZEpFyjAbmphnpxqlIxdJ14TExmS6lGMMjI0tjRMNcGuJQsAFLQpzA",
		allDBsAfter: "fx_sel", allDBsWant: []string{"fx_src", "fx_tgt"},
	},

	{
		set: couchtest.CouchDB35Cluster, version: "3.5.2",
		liveEvents: []DBEvent{
			{DB: "fx_late", Type: "created", Seq: "923-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6CDTMwMTExTTXH1JgFAApTJU8"},
			{DB: "_dbs", Type: "updated", Seq: "924-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6CDTMwMTExTTXH1JgFAArAJVA"},
			{DB: "fx_late", Type: "created", Seq: "925-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6BDTMwMTExTTXH1JgFAArgJVE"},
			{DB: "fx_late", Type: "updated", Seq: "926-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6DDTMwMTExTTXH1JgFAAsAJVI"},
			{DB: "fx_late", Type: "created", Seq: "927-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76ADTMwMTExTTXH1JgFAAsgJVM"},
			{DB: "fx_late", Type: "updated", Seq: "928-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76CDTMwMTExTTXH1JgFAAtAJVQ"},
			{DB: "_dbs", Type: "updated", Seq: "929-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfkAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76CDTMwMTExTTXH1JgFAAutJVU"},
			{DB: "fx_late", Type: "created", Seq: "930-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfkAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76BDTMwMTExTTXH1JgFAAvNJVY"},
			{DB: "fx_late", Type: "updated", Seq: "931-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfkAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76DDTMwMTExTTXH1JgFAAvtJVc"},
			{DB: "_dbs", Type: "updated", Seq: "932-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76DDTMwMTExTTXH1JgFAAxaJVg"},
			{DB: "fx_late", Type: "deleted", Seq: "933-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw36ADTMwMTExTTXH1JgFAAx6JVk"},
			{DB: "_dbs", Type: "updated", Seq: "934-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw36ADTMwMTExTTXH1JgFAAznJVo"},
			{DB: "fx_late", Type: "deleted", Seq: "935-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw36CDTMwMTExTTXH1JgFAA0HJVs"},
			{DB: "_dbs", Type: "updated", Seq: "936-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw36CDTMwMTExTTXH1JgFAA10JVw"},
			{DB: "fx_late", Type: "deleted", Seq: "937-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGNfnAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw36BDTMwMTExTTXH1JgFAA2UJV0"},
		},
		normalEvents: []DBEvent{
			{DB: "fx_src", Type: "created", Seq: "914-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw96CDTMwMTExTTXH1JgFAAeyJUY"},
			{DB: "_dbs", Type: "updated", Seq: "915-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw96CDTMwMTExTTXH1JgFAAgfJUc"},
			{DB: "fx_tgt", Type: "created", Seq: "918-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6ADTMwMTExTTXH1JgFAAh_JUo"},
			{DB: "fx_src", Type: "updated", Seq: "922-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6ADTMwMTExTTXH1JgFAAozJU4"},
		},
		normalLastSeq: "922-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGFflAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6ADTMwMTExTTXH1JgFAAozJU4",
		globalEvents: []DBEvent{
			{DB: "fx_src", Type: "created", Seq: "914-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw96CDTMwMTExTTXH1JgFAAeyJUY"},
			{DB: "fx_tgt", Type: "created", Seq: "917-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iwz6ADTMwMTExTTXH1JgFAAgSJUk"},
			{DB: "fx_late", Type: "created", Seq: "923-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76BDTMwMTExTTXH1JgFAAjSJU8"},
			{DB: "fx_late", Type: "updated", Seq: "924-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGJfmAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76DDTMwMTExTTXH1JgFAAjyJVA"},
			{DB: "fx_created", Type: "created", Seq: "943-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGHfkAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76DDTMwMTExTTXH1JgFABEJJWM"},
		},
		globalLastSeq: "943-g1AAAACZeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYkxgYGHfkAsXYDRONTQ2MLDF14DQljwVIMjQAqf8Iw76DDTMwMTExTTXH1JgFABEJJWM",
		changesNormal: []Change{
			{Seq: "1-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYExlzgQLshmaWiYnGJpjKcRqRxwIkGRqA1H-QSYkMWQA2Eh0p", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYExlzgQLshmaWiYnGJpjKcRqRxwIkGRqA1H8Uk5KNjNLMDA0wdWUBAEMiJA0", ID: "doc1", Revs: []string{"1-3b6ffcfff90ac68478e8935efb41a87f"}},
			{Seq: "3-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYE5lygQLshmaWiYnGJpjKcRqRxwIkGRqA1H-oSYxgk5KNjNLMDA0wdWUBAEOMJA4", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYE5lygQLshmaWiYnGJpjKcRqRxwIkGRqA1H8Uk5KNjNLMDA0wdWUBAEOsJA8", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
		},
		changesNormalLast: "4-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYE5lygQLshmaWiYnGJpjKcRqRxwIkGRqA1H8Uk5KNjNLMDA0wdWUBAEOsJA8",
		changesDeletion: []Change{
			{Seq: "1-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYExlzgQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-QSYkMWQA1mx0p", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-QSYkMWQA15R0q", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "4-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H8Uk5ItTVIN05IwdWUBAEvEJHg", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-oScxgk5ItTVIN05IwdWUBAEvkJHk", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		changesDeletionLast: "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-oScxgk5ItTVIN05IwdWUBAEvkJHk",
		changesLimit: []Change{
			{Seq: "1-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYExlzgQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-QSYkMWQA1mx0p", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "2-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-QSYkMWQA15R0q", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
		},
		changesLimitLast: "2-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQiQ1L9____szKYE5lygQLsJgZGpqnJlpjKcRqRxwIkGRqA1H-QSYkMWQA15R0q", changesLimitPending: 2,
		changesContinuous: []Change{
			{Seq: "1-g1AAAABzeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYExlzgQLshmaWiYnGJpjKcRqRxwIkGRqA1H-QSYkMWQA2Eh0p", ID: "doc2", Revs: []string{"1-614d864b534ab8997c7b06ce8a683752"}},
			{Seq: "3-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYExlzgQLshmaWiYnGJpjKcRqRxwIkGRqA1H-oSUxgk5KNjNLMDA0wdWUBAENCJA4", ID: "doc4", Revs: []string{"1-2c4050d09fe968ae265c1ff083ccbd0c"}},
			{Seq: "4-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYE5lygQLshmaWiYnGJpjKcRqRxwIkGRqA1H8Uk5KNjNLMDA0wdWUBAEOsJA8", ID: "doc3", Revs: []string{"1-7f02460a69174bbf151a830adf97f9e6"}},
			{Seq: "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTVyMDQy1zMAQsMckEQiQ1L9____szKYE5lygQLshmaWiYnGJpjKcRqRxwIkGRqA1H-oScxgk5KNjNLMDA0wdWUBAEPMJBA", ID: "doc1", Deleted: true, Revs: []string{"2-e756583c203257552e07a1bfc6aa9047"}},
		},
		dbsInfoSrc: DBInfo{Name: "fx_src", DocCount: 3, InstanceStartTime: "1795648257",
			UpdateSeq: "5-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kTkXKMCebGmSapiWhKkLp0mJDEn1UCOYwEaYGBiZpiZbYirPAgA6DiR5"},
		dbsInfoTgtSeq: "0-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kSEXKMCenJyYYm5ugKkLp0mJDEn1KEYYmJqYGZgmYSrPAgAzjiQ5",
		getDBStart:    "1795648257", getDBSeq: "4-g1AAAACTeJzLYWBgYMpgTmHgz8tPSTV0MDQy1zMAQsMckEQeC5BkaABS_4EgK4M5kSkXKMCebGmSapiWhKkLbpIRmkmJDEn1KEYYmlkmJhqbYCrPAgA6KiR3",
		allDBsAfter: "fx_sel", allDBsWant: []string{"fx_src", "fx_tgt"},
	},
}

// collector gathers emitted items for tests.
type collector[T any] struct {
	mu    sync.Mutex
	items []T
}

func (c *collector[T]) emit(item T) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.items = append(c.items, item)
	return nil
}

func (c *collector[T]) get() []T {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]T(nil), c.items...)
}

func (c *collector[T]) len() int { return len(c.get()) }

// runAsync runs fn in a goroutine and returns a channel with its result.
func runAsync(fn func() error) <-chan error {
	done := make(chan error, 1)
	go func() { done <- fn() }()
	return done
}

func waitDone(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("feed did not return within 10s")
		return nil
	}
}

// forEachSet runs fn as a parallel subtest per fixture set.
func forEachSet(t *testing.T, fn func(t *testing.T, fx fxSet)) {
	t.Helper()
	for _, fx := range fxSets {
		t.Run(fx.set, func(t *testing.T) {
			t.Parallel()
			fn(t, fx)
		})
	}
}

func TestFixtureUpdatesFeeds(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		tests := []struct {
			name     string
			source   string
			fixture  string
			since    string
			want     []DBEvent
			wantFeed string // feed of the first request
			nextFrom string // since of the continuous request after the fixture
		}{
			{"db_updates continuous", SourceDBUpdates, "db-updates-continuous-live.http", "", fx.liveEvents, "continuous", fx.liveEvents[len(fx.liveEvents)-1].Seq},
			{"db_updates normal for since=now", SourceDBUpdates, "db-updates-normal.http", SinceNow, fx.normalEvents, "normal", fx.normalLastSeq},
			{"global_changes normal for since=now", SourceGlobalChanges, "global-changes.http", SinceNow, fx.globalEvents, "normal", fx.globalLastSeq},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				t.Parallel()
				srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, tt.fixture)))
				c, _ := newTestClient(t, srv.URL)
				feed, err := c.NewUpdatesFeed(t.Context(), tt.source, FeedOptions{Heartbeat: time.Second})
				require.NoError(t, err)
				assert.Equal(t, tt.source, feed.Source())
				ctx, cancel := context.WithCancel(t.Context())
				var got collector[DBEvent]
				done := runAsync(func() error { return feed.Run(ctx, tt.since, got.emit) })
				require.Eventually(t, func() bool { return srv.count() >= 2 && got.len() >= len(tt.want) },
					5*time.Second, 5*time.Millisecond)
				cancel()
				require.ErrorIs(t, waitDone(t, done), context.Canceled)
				assert.Equal(t, tt.want, got.get())
				reqs := srv.requests()
				assert.Equal(t, tt.wantFeed, reqs[0].Query().Get("feed"))
				assert.Equal(t, tt.since, reqs[0].Query().Get("since"))
				assert.Equal(t, "continuous", reqs[1].Query().Get("feed"))
				assert.Equal(t, tt.nextFrom, reqs[1].Query().Get("since"), "the feed resumes after the last event")
				assert.Equal(t, "1000", reqs[1].Query().Get("heartbeat"))
			})
		}
	})
}

func TestFixtureParseGlobalChangesRows(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		var body struct {
			Results []json.RawMessage `json:"results"`
		}
		require.NoError(t, json.Unmarshal(fixtureBody(t, fx.set, "global-changes.http"), &body))
		var got []DBEvent
		for _, row := range body.Results {
			ev, seq, ok, err := parseGlobalChangesLine(row)
			require.NoError(t, err)
			require.True(t, ok)
			assert.Equal(t, ev.Seq, seq)
			got = append(got, ev)
		}
		assert.Equal(t, fx.globalEvents, got)
	})
}

func TestFixtureChanges(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		tests := []struct {
			fixture     string
			opt         ChangesOptions
			want        []Change
			wantLast    string
			wantPending int64
			wantDocs    bool
			wantQuery   map[string]string
		}{
			{"changes-normal.http", ChangesOptions{IncludeDocs: true, AllDocs: true}, fx.changesNormal, fx.changesNormalLast, 0, true,
				map[string]string{"include_docs": "true", "style": "all_docs", "feed": "normal"}},
			{"changes-with-deletion.http", ChangesOptions{AllDocs: true}, fx.changesDeletion, fx.changesDeletionLast, 0, false,
				map[string]string{"style": "all_docs", "include_docs": ""}},
			{"changes-limit.http", ChangesOptions{Limit: 2, Since: "0"}, fx.changesLimit, fx.changesLimitLast, fx.changesLimitPending, false,
				map[string]string{"limit": "2", "since": "0"}},
		}
		for _, tt := range tests {
			t.Run(tt.fixture, func(t *testing.T) {
				t.Parallel()
				srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, tt.fixture)))
				c, _ := newTestClient(t, srv.URL)
				page, err := c.Changes(t.Context(), "fx_src", tt.opt)
				require.NoError(t, err)
				assert.Equal(t, tt.wantLast, page.LastSeq)
				assert.Equal(t, tt.wantPending, page.Pending)
				require.Len(t, page.Results, len(tt.want))
				for i, ch := range page.Results {
					assert.Equal(t, tt.want[i].ID, ch.ID)
					assert.Equal(t, tt.want[i].Seq, ch.Seq)
					assert.Equal(t, tt.want[i].Deleted, ch.Deleted)
					assert.Equal(t, tt.want[i].Revs, ch.Revs)
					if tt.wantDocs {
						var doc struct {
							ID  string `json:"_id"`
							Rev string `json:"_rev"`
						}
						require.NoError(t, json.Unmarshal(ch.Doc, &doc))
						assert.Equal(t, ch.ID, doc.ID)
						assert.Equal(t, ch.Revs[0], doc.Rev)
					} else {
						assert.Nil(t, ch.Doc)
					}
				}
				q := srv.requests()[0].Query()
				assert.Equal(t, "/fx_src/_changes", srv.requests()[0].Path)
				for k, v := range tt.wantQuery {
					assert.Equal(t, v, q.Get(k), k)
				}
			})
		}
	})
}

func TestFixtureFollowChanges(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, "changes-continuous.http")))
		c, _ := newTestClient(t, srv.URL)
		ctx, cancel := context.WithCancel(t.Context())
		var got collector[Change]
		done := runAsync(func() error {
			return c.FollowChanges(ctx, "fx_src", ChangesOptions{IncludeDocs: true, Heartbeat: time.Second}, got.emit)
		})
		require.Eventually(t, func() bool { return srv.count() >= 2 }, 5*time.Second, 5*time.Millisecond)
		cancel()
		require.ErrorIs(t, waitDone(t, done), context.Canceled)
		changes := got.get()
		want := fx.changesContinuous
		require.Len(t, changes, len(want))
		for i, ch := range changes {
			assert.Equal(t, want[i].ID, ch.ID)
			assert.Equal(t, want[i].Seq, ch.Seq)
			assert.Equal(t, want[i].Deleted, ch.Deleted)
			assert.Equal(t, want[i].Revs, ch.Revs)
			assert.NotNil(t, ch.Doc)
			if ch.ID == "doc1" {
				assert.JSONEq(t, `{"_id":"doc1","_rev":"2-e756583c203257552e07a1bfc6aa9047","_deleted":true}`, string(ch.Doc))
			}
		}
		assert.Equal(t, want[len(want)-1].Seq, srv.requests()[1].Query().Get("since"))
	})
}

func TestFixtureDBInfos(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		var body []byte
		fixture := fixtureBody(t, fx.set, "dbs-info.http") // read here: t.Skip only works in the test goroutine
		srv := newFakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			body = make([]byte, r.ContentLength)
			_, _ = r.Body.Read(body)
			serveBody(http.StatusOK, fixture)(w, r)
		})
		c, _ := newTestClient(t, srv.URL)
		infos, err := c.DBInfos(t.Context(), []string{"fx_src", "fx_tgt", "fx_missing"})
		require.NoError(t, err)
		assert.JSONEq(t, `{"keys":["fx_src","fx_tgt","fx_missing"]}`, string(body))
		assert.Equal(t, "/_dbs_info", srv.requests()[0].Path)
		require.Len(t, infos, 2)
		assert.NotContains(t, infos, "fx_missing")
		assert.Equal(t, fx.dbsInfoSrc, infos["fx_src"])
		assert.Equal(t, int64(0), infos["fx_tgt"].DocCount)
		assert.Equal(t, fx.dbsInfoTgtSeq, infos["fx_tgt"].UpdateSeq)
		assert.Equal(t, fx.dbsInfoSrc.InstanceStartTime, infos["fx_tgt"].InstanceStartTime)
	})
}

func TestFixtureSingleAnswers(t *testing.T) {
	t.Parallel()
	forEachSet(t, func(t *testing.T, fx fxSet) {
		t.Run("root", func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, "root.http")))
			c, _ := newTestClient(t, srv.URL)
			info, err := c.Server(t.Context())
			require.NoError(t, err)
			assert.Equal(t, ServerInfo{Vendor: "The Apache Software Foundation", Version: fx.version, CouchDB: true, Major: 3}, info)
			again, err := c.Server(t.Context())
			require.NoError(t, err)
			assert.Equal(t, info, again)
			assert.Equal(t, 1, srv.count(), "the server info is cached")
		})
		t.Run("missing db", func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusNotFound, fixtureBody(t, fx.set, "get-db-missing.http")))
			c, _ := newTestClient(t, srv.URL)
			_, err := c.DBInfo(t.Context(), "fx_missing")
			require.ErrorIs(t, err, ErrNotFound)
			var he *HTTPError
			require.ErrorAs(t, err, &he)
			assert.Equal(t, HTTPError{Status: 404, ErrorName: "not_found", Reason: "Database does not exist.", Method: "GET", Path: "/fx_missing"}, *he)
		})
		t.Run("get db", func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, "get-db.http")))
			c, _ := newTestClient(t, srv.URL)
			info, err := c.DBInfo(t.Context(), "fx_src")
			require.NoError(t, err)
			assert.Equal(t, DBInfo{Name: "fx_src", UpdateSeq: fx.getDBSeq, InstanceStartTime: fx.getDBStart, DocCount: 4}, info)
		})
		t.Run("all dbs", func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, fx.set, "all-dbs.http")))
			c, _ := newTestClient(t, srv.URL)
			dbs, err := c.AllDBs(t.Context(), fx.allDBsAfter, len(fx.allDBsWant))
			require.NoError(t, err)
			assert.Equal(t, fx.allDBsWant, dbs)
			assert.Equal(t, `"`+fx.allDBsAfter+`"`, srv.requests()[0].Query().Get("startkey"))
			assert.Equal(t, strconv.Itoa(len(fx.allDBsWant)+1), srv.requests()[0].Query().Get("limit"))
		})
		t.Run("unauthorized feed", func(t *testing.T) {
			t.Parallel()
			srv := newFakeServer(t, serveBody(http.StatusUnauthorized, fixtureBody(t, fx.set, "unauthorized.http")))
			c, _ := newTestClient(t, srv.URL)
			feed, err := c.NewUpdatesFeed(t.Context(), SourceDBUpdates, FeedOptions{})
			require.NoError(t, err)
			err = feed.Run(t.Context(), "", func(DBEvent) error { return nil })
			var he *HTTPError
			require.ErrorAs(t, err, &he)
			assert.Equal(t, 401, he.Status)
			assert.True(t, IsPermanent(err))
			assert.Contains(t, err.Error(), "You are not a server admin.")
			assert.Equal(t, 1, srv.count(), "a permanent error is not retried")
			require.False(t, errors.Is(err, ErrNotFound))
		})
	})
}

// dropConnection closes the connection without an answer: the node is lost mid-request.
func dropConnection(w http.ResponseWriter, _ *http.Request) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err == nil {
		_ = conn.Close()
	}
}

// A cluster's seqs are the node's own (node 2 sends other strings for the same changes), yet a
// node accepts another's seq as since: recorded from a three-node CouchDB 3.5.2, node 2 answered
// node 1's last_seq with no rows and that same last_seq. So when the node a feed follows is lost,
// the feed resumes on the next node of the list from the last seq node 1 sent, verbatim, and
// re-emits nothing.
func TestFixtureClusterFeedMovesToAnotherNode(t *testing.T) {
	t.Parallel()
	set := couchtest.CouchDB35Cluster
	want := fxSets[2].changesContinuous
	require.Equal(t, set, fxSets[2].set)

	other := couchtest.FixtureFrom(t, set, "changes-since-other-node")
	since := strings.TrimPrefix(other.Request[0], "GET /fx_src/_changes?since=")
	var page struct {
		Results []json.RawMessage `json:"results"`
		LastSeq string            `json:"last_seq"`
	}
	require.NoError(t, json.Unmarshal(other.Body, &page))
	assert.Equal(t, http.StatusOK, other.Status)
	assert.Empty(t, page.Results)
	assert.Equal(t, since, page.LastSeq, "node 2 took node 1's seq as its own position")
	assert.NotEqual(t, fxSets[1].changesContinuous[0].Seq, want[0].Seq, "the cluster's seqs are not the single node's")

	// node 1 sends the feed, then is lost: every later request's connection drops
	node1 := newFakeServer(t, serveBody(http.StatusOK, fixtureBody(t, set, "changes-continuous")),
		dropConnection, dropConnection, dropConnection, dropConnection)
	node2 := newFakeServer(t, serveBody(http.StatusOK, []byte("\n")))
	c, _ := newTestClient(t, node1.URL+","+node2.URL)
	ctx, cancel := context.WithCancel(t.Context())
	var got collector[Change]
	done := runAsync(func() error {
		return c.FollowChanges(ctx, "fx_src", ChangesOptions{IncludeDocs: true, Heartbeat: time.Second}, got.emit)
	})
	require.Eventually(t, func() bool { return node2.count() >= 2 }, 5*time.Second, 5*time.Millisecond)
	cancel()
	require.ErrorIs(t, waitDone(t, done), context.Canceled)

	require.Len(t, got.get(), len(want), "nothing is emitted twice")
	assert.LessOrEqual(t, node1.count(), 3, "the feed, the lost request and the transport's own retry")
	assert.Equal(t, strings.TrimPrefix(node2.URL, "http://"), c.NodeInUse())
	for _, r := range node2.requests()[:2] {
		assert.Equal(t, want[len(want)-1].Seq, r.Query().Get("since"), "node 1's seq goes to node 2 as it is")
	}
}
